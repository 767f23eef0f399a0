"""Blocking-socket framing and the authenticated handshake of the TCP
transport (see proto/kvrelay/v1/kv_wire.proto for the frame sequence)."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
import struct
from typing import Protocol

from kvrelay.v1 import kv_wire_pb2 as pb

PROTOCOL_VERSION = 2
MAX_FRAME = 1 << 20
"""Largest header frame accepted (payloads are not frames)."""
NONCE_BYTES = 16
SHM_NAME = re.compile(r"/dev/shm/kvrelay-[A-Za-z0-9_.-]+")
"""Shared-memory KV files a receiver agrees to map."""


class ProtocolError(Exception):
    """The peer broke the wire protocol or the handshake."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from the socket (zero-copy into its memory)."""
    got = 0
    n = len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r


def send_frame(sock: socket.socket, frame: pb.KVFrame) -> None:
    body = frame.SerializeToString()
    sock.sendall(struct.pack("<I", len(body)) + body)


def recv_frame(sock: socket.socket) -> pb.KVFrame:
    head = bytearray(4)
    recv_exact_into(sock, memoryview(head))
    (n,) = struct.unpack("<I", head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    body = bytearray(n)
    recv_exact_into(sock, memoryview(body))
    frame = pb.KVFrame()
    try:
        frame.ParseFromString(bytes(body))
    except Exception as exc:  # protobuf's DecodeError has no stable import path
        raise ProtocolError(f"undecodable frame: {exc}") from None
    return frame


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes, hello: pb.KVHello) -> bytes:
    """HMAC over both nonces and the whole hello (layout hash and any offer of
    shared memory or NIXL metadata), so none of it can be altered in flight."""
    digest = hashlib.sha256(hello.SerializeToString(deterministic=True)).digest()
    return hmac.new(secret, role + first + second + digest, hashlib.sha256).digest()


def host_id() -> str:
    """Identifies this host (its kernel boot id): equal ids share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class PayloadCipher:
    """AES-256-GCM for one connection's KV payloads, sender to receiver.
    Nonces are a frame counter, so a replayed or reordered frame fails."""

    TAG = 16

    def __init__(self, secret: bytes, nonce_s: bytes, nonce_r: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        key = hmac.new(secret, b"kvrelay-kv-payload-key" + nonce_s + nonce_r, hashlib.sha256).digest()
        self._aes = AESGCM(key)
        self._counter = 0

    def _nonce(self) -> bytes:
        self._counter += 1
        return self._counter.to_bytes(12, "big")

    def skip(self) -> None:
        """Keeps in step with the sender past a payload that was discarded unread."""
        self._counter += 1

    def seal(self, data: bytes) -> bytes:
        return self._aes.encrypt(self._nonce(), data, None)

    def open(self, data: bytes) -> bytes:
        """Raises ProtocolError when the payload was altered."""
        from cryptography.exceptions import InvalidTag

        try:
            return self._aes.decrypt(self._nonce(), data, None)
        except InvalidTag:
            raise ProtocolError("encrypted KV payload failed authentication (altered in flight)") from None


def client_handshake(sock: socket.socket, secret: bytes, layout_hash: str, offer: pb.KVHello | None = None,
                     encrypt: bool = False) -> tuple[bool, PayloadCipher | None]:
    """Sender side: proves the secret and checks the receiver's proof.

    ``offer`` carries the KVHello fields that let the receiver pull blocks
    itself (shared memory, NIXL). Returns whether it will, and the payload
    cipher when ``encrypt`` was asked for."""
    nonce_s = os.urandom(NONCE_BYTES)
    hello = pb.KVHello(protocol_version=PROTOCOL_VERSION, layout_hash=layout_hash, nonce=nonce_s, encrypt=encrypt)
    if offer is not None:
        hello.MergeFrom(offer)
    send_frame(sock, pb.KVFrame(hello=hello))
    ack = recv_frame(sock)
    if ack.WhichOneof("body") != "hello_ack":
        raise ProtocolError("expected hello_ack")
    if not ack.hello_ack.accepted:
        raise ProtocolError(f"refused by receiver: {ack.hello_ack.reason}")
    nonce_r = ack.hello_ack.nonce
    if not hmac.compare_digest(ack.hello_ack.proof, _proof(secret, b"R", nonce_s, nonce_r, hello)):
        raise ProtocolError("receiver failed authentication (wrong deployment secret?)")
    send_frame(sock, pb.KVFrame(auth=pb.KVAuth(proof=_proof(secret, b"S", nonce_r, nonce_s, hello))))
    shared = ack.hello_ack.shared_memory
    ack = recv_frame(sock)
    if ack.WhichOneof("body") != "auth_ack" or not ack.auth_ack.accepted:
        raise ProtocolError(f"refused by receiver: {ack.auth_ack.reason or 'authentication failed'}")
    return shared, (PayloadCipher(secret, nonce_s, nonce_r) if encrypt else None)


class PeerAttacher(Protocol):
    """How a receiver pulls from a sender's memory (shared memory, NIXL)."""

    def can_attach(self, hello: pb.KVHello) -> bool:
        """Cheap checks before authentication: will we pull from this sender?"""

    def attach(self, hello: pb.KVHello) -> object:
        """After authentication: map or connect the sender's KV memory."""


def server_handshake(sock: socket.socket, secret: bytes, layout_hash: str,
                     attacher: PeerAttacher | None = None, require_encryption: bool = False
                     ) -> tuple[object, PayloadCipher | None]:
    """Receiver side: checks version, layout and the sender's proof before
    anything else is read. Raises ProtocolError (after telling the peer why).
    Returns the attached sender memory (or None for bytes on the wire) and
    the payload cipher when the sender encrypts."""
    hello = recv_frame(sock)
    if hello.WhichOneof("body") != "hello":
        raise ProtocolError("expected hello")
    h = hello.hello
    reason = ""
    if h.protocol_version != PROTOCOL_VERSION:
        reason = f"protocol version {h.protocol_version} unsupported (receiver speaks {PROTOCOL_VERSION})"
    elif h.layout_hash != layout_hash:
        reason = "KV layout mismatch (model, dtype, layers, KV heads, head dim or block size differ)"
    elif len(h.nonce) != NONCE_BYTES:
        reason = "bad nonce"
    elif require_encryption and not h.encrypt:
        reason = "this receiver requires encrypted KV payloads"
    if reason:
        send_frame(sock, pb.KVFrame(hello_ack=pb.KVHelloAck(accepted=False, reason=reason)))
        raise ProtocolError(reason)
    # Agree to pull before authentication, but touch the sender's memory only after.
    shared = attacher is not None and attacher.can_attach(h)
    nonce_r = os.urandom(NONCE_BYTES)
    send_frame(sock, pb.KVFrame(hello_ack=pb.KVHelloAck(
        accepted=True, nonce=nonce_r, proof=_proof(secret, b"R", h.nonce, nonce_r, h),
        shared_memory=shared)))
    auth = recv_frame(sock)
    ok = auth.WhichOneof("body") == "auth" and hmac.compare_digest(
        auth.auth.proof, _proof(secret, b"S", nonce_r, h.nonce, h))
    if not ok:
        send_frame(sock, pb.KVFrame(auth_ack=pb.KVAuthAck(accepted=False, reason="authentication failed")))
        raise ProtocolError("sender failed authentication (wrong deployment secret?)")
    peer_kv = None
    if shared:
        try:
            peer_kv = attacher.attach(h)
        except (OSError, ValueError, RuntimeError) as exc:
            send_frame(sock, pb.KVFrame(auth_ack=pb.KVAuthAck(accepted=False,
                                                              reason=f"cannot attach the sender's KV: {exc}")))
            raise ProtocolError(f"cannot attach the sender's KV: {exc}") from None
    send_frame(sock, pb.KVFrame(auth_ack=pb.KVAuthAck(accepted=True)))
    return peer_kv, (PayloadCipher(secret, h.nonce, nonce_r) if h.encrypt else None)


def tune_socket(sock: socket.socket, buffer_bytes: int | None) -> None:
    """No Nagle delay; socket buffers sized to the link's bandwidth-delay product."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def bdp_bytes(gbps: float, rtt_ms: float, floor: int = 4 << 20) -> int:
    """Bandwidth-delay product of a link (at least ``floor``)."""
    return max(floor, int(gbps * 1e9 / 8 * rtt_ms / 1e3))
