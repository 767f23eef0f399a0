"""What protects KV on the wire: the protection a link asks for, the AEAD
that gives it, and the key schedule of a connection (kv_wire.proto)."""

from __future__ import annotations

import functools
import hashlib
import hmac
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

CONTEXT = b"kvrelay-kv-4"
"""Names the protocol in every transcript hash and key derivation."""


class Protection(StrEnum):
    """What a link asks of every frame on it. Both authenticate every byte."""

    AEAD = "aead"
    """Encrypted and authenticated (the default everywhere)."""
    INTEGRITY = "integrity"
    """Authenticated, readable: the AEAD's tag over header and payload (a MAC),
    for operators who want it inside one machine room."""

    @property
    def strength(self) -> int:
        return 1 if self is Protection.AEAD else 0

    def satisfies(self, required: Protection) -> bool:
        """At least as strong as ``required``."""
        return self.strength >= required.strength

    @classmethod
    def parse(cls, value: str) -> Protection:
        """The protection named ``value``; ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"protection must be aead or integrity, got {value!r}") from None


class Cipher(StrEnum):
    """The AEADs a connection may use (both: 256-bit keys, 96-bit nonces, 16-byte tags)."""

    AES_256_GCM = "aes-256-gcm"
    CHACHA20_POLY1305 = "chacha20-poly1305"

    def aead(self, key: bytes) -> AESGCM | ChaCha20Poly1305:
        return AESGCM(key) if self is Cipher.AES_256_GCM else ChaCha20Poly1305(key)


@functools.lru_cache(maxsize=1)
def cpu_has_aes() -> bool:
    """Whether this CPU has AES instructions (x86 ``aes``, Arm ``aes`` feature)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return "aes" in line.split(":", 1)[1].split()
    return True


def preferred_ciphers() -> list[Cipher]:
    """This host's ciphers, fastest first: AES-GCM with AES instructions, else ChaCha20-Poly1305."""
    both = [Cipher.AES_256_GCM, Cipher.CHACHA20_POLY1305]
    return both if cpu_has_aes() else both[::-1]


def choose_cipher(offered: list[str]) -> Cipher | None:
    """The receiver's pick among a sender's offer: the first of our preferred ones it offers."""
    names = set(offered)
    return next((c for c in preferred_ciphers() if c.value in names), None)


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """One connection's keys, all from HKDF over its handshake."""

    to_receiver: bytes
    """Seals records from sender to receiver."""
    to_sender: bytes
    """Seals records from receiver to sender."""
    receiver_mac: bytes
    """Keys the receiver's proof."""
    sender_mac: bytes
    """Keys the sender's proof."""


class KeyShare:
    """One side's ephemeral X25519 key, used for one connection (forward secrecy)."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes_raw()

    def keys(self, peer_public: bytes, secret: bytes, th1: bytes) -> SessionKeys:
        """The session keys from the peer's share, the deployment secret and th1.
        ValueError for a malformed share."""
        if len(peer_public) != 32:
            raise ValueError("key share must be 32 bytes")
        shared = self._key.exchange(X25519PublicKey.from_public_bytes(peer_public))
        okm = HKDF(hashes.SHA256(), 128, salt=th1, info=CONTEXT + b" keys").derive(shared + secret)
        return SessionKeys(okm[:32], okm[32:64], okm[64:96], okm[96:])


def transcript_1(hello: bytes, answer: bytes) -> bytes:
    """th1: the sender's hello and the receiver's answer, as the exact bytes sent."""
    return hashlib.sha256(CONTEXT + len(hello).to_bytes(4, "big") + hello + answer).digest()


def transcript_2(th1: bytes, signature: bytes, proof: bytes) -> bytes:
    """th2: th1 and the receiver's proofs (what the sender's proofs cover)."""
    return hashlib.sha256(th1 + len(signature).to_bytes(4, "big") + signature + proof).digest()


def mac_proof(key: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, transcript, hashlib.sha256).digest()


def signed_message(side: bytes, transcript: bytes) -> bytes:
    """What a side's certificate key signs: its side (b"receiver" / b"sender") and the transcript."""
    return CONTEXT + b" " + side + b"\0" + transcript
