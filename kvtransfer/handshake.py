"""The KV handshake (kv_wire.proto): both ends prove who they are (their
certificates' keys sign the transcript; MACs prove the deployment secret),
agree on a cipher and the protection of the link, and derive this
connection's keys. Only then does the sender's memory offer travel, sealed.

The sender runs :func:`client_handshake` on a blocking socket; the receiver
runs :func:`answer_hello` and :func:`check_auth` in its gate (non-blocking,
one thread for all pending peers) and :func:`accept_peer` on the thread
that then serves the connection."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvrelay.kvtransfer.base import Credentials, KVCodec, MemorySource, PeerId
from kvrelay.kvtransfer.protection import (
    Cipher,
    KeyShare,
    Protection,
    SessionKeys,
    choose_cipher,
    mac_proof,
    preferred_ciphers,
    signed_message,
    transcript_1,
    transcript_2,
)
from kvrelay.kvtransfer.record import RecordReader, RecordWriter
from kvrelay.kvtransfer.wire import (
    MAX_SOCKET_BUFFER,
    PROTOCOL_VERSION,
    ProtocolError,
    frame_bytes,
    recv_frame,
    send_frame,
    tune_socket,
)
from kvrelay.v1 import kv_wire_pb2 as pb

NONCE_BYTES = 32
HELLO_WINDOW_S = 120.0
"""How far a hello's clock may be from the receiver's (clocks kept by NTP); a
receiver remembers every hello's nonce this long, so a replayed hello is
refused at the cost of a MAC."""
_STAMP_INFO = b"kvrelay kv hello stamp v1"


@dataclass(slots=True)
class Session:
    """One authenticated connection: its records each way and who is at the other end."""

    writer: RecordWriter
    reader: RecordReader
    peer: PeerId | None
    """What the peer's certificate names (None: no certificates, secret only)."""
    protection: Protection
    shared: bool = False
    """The receiver pulls from the sender's memory (frames carry block ids only)."""
    codec: KVCodec = KVCodec.NONE
    """The codec of every blocks frame on this connection (the hello's)."""


class PeerAttacher(Protocol):
    """How a receiver maps a sender's memory to pull from (kvtransfer/local.py:
    shared memory, kvtransfer/nixl.py: NIXL)."""

    same_host: bool
    """Pulled bytes never leave this host (shared memory). Otherwise (NIXL)
    they cross the fabric as they are: allowed only on an integrity link."""

    def can_attach(self, offer: pb.KVOffer) -> bool:
        """Will we pull from this (authenticated) sender?"""

    def attach(self, offer: pb.KVOffer) -> MemorySource:
        """Map or connect the sender's KV memory."""


@dataclass(frozen=True, slots=True)
class SenderHello:
    """What a sender asks of one connection."""

    secret: bytes
    layout_hash: str
    credentials: Credentials | None
    protection: Protection
    receiver: str | None = None
    """The receiver identity (site/role/name) its certificate must name; None = any we accept."""
    socket_buffer_bytes: int | None = None
    codec: KVCodec = KVCodec.NONE
    """The codec of this connection's blocks frames (kvtransfer/coded.py)."""


def _identify(creds: Credentials | None, cert: bytes, what: str) -> PeerId | None:
    if creds is None:
        return None
    if not cert:
        raise ProtocolError(f"the {what} presented no certificate (this end requires one: tls is on)")
    try:
        return creds.identify(cert)
    except ValueError as exc:
        raise ProtocolError(f"the {what}'s certificate is refused: {exc}") from None


def _check_signature(creds: Credentials | None, cert: bytes, message: bytes, signature: bytes, what: str) -> None:
    if creds is None:
        return
    try:
        creds.verify_signature(cert, message, signature)
    except ValueError as exc:
        raise ProtocolError(f"the {what} failed authentication: its signature does not verify ({exc})") from None


def hello_stamp(secret: bytes, hello: pb.KVHello) -> bytes:
    """HMAC-SHA256, under a key derived from the deployment secret, of ``hello`` with its stamp empty."""
    unstamped = pb.KVHello()
    unstamped.CopyFrom(hello)
    unstamped.stamp = b""
    key = hmac.new(secret, _STAMP_INFO, hashlib.sha256).digest()
    return hmac.new(key, unstamped.SerializeToString(deterministic=True), hashlib.sha256).digest()


def early_refusal(frame: pb.KVFrame, secret: bytes, now_s: float) -> str:
    """Receiver, before any certificate or key-exchange work: "" when the frame is
    a hello of our protocol, stamped with the deployment secret within
    HELLO_WINDOW_S of ``now_s`` (the receiver still checks its nonce is new)."""
    if frame.WhichOneof("body") != "hello":
        return "expected hello"
    h = frame.hello
    reason = _hello_refusal(h, None)
    if reason:
        return reason
    if abs(now_s * 1e3 - h.sent_unix_ms) > HELLO_WINDOW_S * 1e3:
        return f"hello sent more than {HELLO_WINDOW_S:g} s from now (a replay, or the sender's clock is off)"
    if not hmac.compare_digest(h.stamp, hello_stamp(secret, h)):
        return "hello failed authentication: not stamped with the deployment secret (wrong secret?)"
    return ""


def refusal_answer(reason: str) -> bytes:
    """The hello_ack frame that tells a sender its hello was refused, and why."""
    return _refuse(reason)[1]


def _check_answer(a: pb.KVHelloAnswer, hello: pb.KVHello) -> Cipher:
    if not a.accepted:
        raise ProtocolError(f"refused by receiver: {a.reason}")
    if a.cipher not in hello.ciphers or a.protection != hello.protection:
        raise ProtocolError(f"receiver answered cipher {a.cipher!r} and protection {a.protection!r}; "
                            f"we offered {list(hello.ciphers)} and {hello.protection!r}")
    if len(a.nonce) != NONCE_BYTES:
        raise ProtocolError("receiver sent a bad nonce")
    return Cipher(a.cipher)


def client_handshake(sock: socket.socket, want: SenderHello, offer: pb.KVOffer | None = None) -> Session:
    """Sender side, on a connected blocking socket: authenticates both ends,
    then sends ``offer`` (what lets the receiver pull from our memory) sealed.
    ProtocolError saying why the receiver or we refused."""
    share, creds = KeyShare(), want.credentials.pinned() if want.credentials else None
    hello = pb.KVHello(protocol_version=PROTOCOL_VERSION, layout_hash=want.layout_hash, nonce=os.urandom(NONCE_BYTES),
                       key_share=share.public, certificate=creds.certificate if creds else b"",
                       ciphers=[c.value for c in preferred_ciphers()], protection=want.protection.value,
                       socket_buffer_bytes=want.socket_buffer_bytes or 0, sent_unix_ms=int(time.time() * 1e3),
                       codec="" if want.codec is KVCodec.NONE else want.codec.value)
    hello.stamp = hello_stamp(want.secret, hello)
    body = send_frame(sock, pb.KVFrame(hello=hello))
    frame, _ = recv_frame(sock)
    if frame.WhichOneof("body") != "hello_ack":
        raise ProtocolError("expected hello_ack")
    ack = frame.hello_ack
    answer = pb.KVHelloAnswer.FromString(ack.answer)
    cipher = _check_answer(answer, hello)
    th1 = transcript_1(body, ack.answer)
    try:
        keys = share.keys(answer.key_share, want.secret, th1)
    except ValueError as exc:
        raise ProtocolError(f"receiver sent a bad key share ({exc})") from None
    if not hmac.compare_digest(ack.proof, mac_proof(keys.receiver_mac, th1)):
        raise ProtocolError("receiver failed authentication (wrong deployment secret?)")
    peer = _identify(creds, answer.certificate, "receiver")
    _check_signature(creds, answer.certificate, signed_message(b"receiver", th1), ack.signature, "receiver")
    if peer is not None and want.receiver and peer.path != want.receiver:
        raise ProtocolError(f"the receiver is {peer}, not kvrelay://{want.receiver} as the router said")
    th2 = transcript_2(th1, ack.signature, ack.proof)
    send_frame(sock, pb.KVFrame(auth=pb.KVAuth(
        signature=creds.sign(signed_message(b"sender", th2)) if creds else b"",
        proof=mac_proof(keys.sender_mac, th2))))
    protection = Protection(answer.protection)
    session = Session(RecordWriter(sock, cipher, keys.to_receiver, protection),
                      RecordReader(sock, cipher, keys.to_sender, protection), peer, protection)
    session.writer.send(pb.KVFrame(offer=offer or pb.KVOffer()))
    frame, _ = session.reader.recv()
    if frame.WhichOneof("body") != "auth_ack":
        raise ProtocolError("expected auth_ack")
    if not frame.auth_ack.accepted:
        raise ProtocolError(f"refused by receiver: {frame.auth_ack.reason}")
    session.shared, session.codec = frame.auth_ack.shared_memory, want.codec
    return session


@dataclass(frozen=True, slots=True)
class ReceiverPolicy:
    """What a receiver checks of every sender."""

    secret: bytes
    layout_hash: str
    credentials: Credentials | None
    required: Callable[[str | None], Protection]
    """The protection the link from a sender's site asks (its certificate's
    site; None without certificates)."""
    codecs: frozenset[KVCodec] = frozenset({KVCodec.NONE})
    """The KV codecs this receiver decodes into its cache (kvtransfer/coded.py's ``codecs_for``)."""


@dataclass(slots=True)
class PendingPeer:
    """A sender whose hello was accepted; its proofs come next."""

    hello: pb.KVHello
    th1: bytes
    keys: SessionKeys
    cipher: Cipher
    protection: Protection
    peer: PeerId | None
    ack: pb.KVHelloAck


def _hello_refusal(h: pb.KVHello, policy: ReceiverPolicy | None) -> str:
    """Why the hello's own fields are unacceptable ("" when they are not); the layout too with ``policy``."""
    if h.protocol_version != PROTOCOL_VERSION:
        return f"protocol version {h.protocol_version} unsupported (receiver speaks {PROTOCOL_VERSION})"
    if policy is not None and h.layout_hash != policy.layout_hash:
        return "KV layout mismatch (model, dtype, layers, KV heads, head dim or block size differ)"
    if len(h.nonce) != NONCE_BYTES or len(h.key_share) != 32:
        return "bad nonce or key share"
    if choose_cipher(list(h.ciphers)) is None:
        return f"no cipher in common (offered {list(h.ciphers)})"
    if h.protection not in set(Protection):
        return f"unknown protection {h.protection!r}"
    try:
        codec = KVCodec.parse(h.codec)
    except ValueError as exc:
        return str(exc)
    if policy is not None and codec not in policy.codecs:
        return f"KV codec {codec} refused: this receiver's cache takes only {', '.join(sorted(policy.codecs))}"
    return ""


def _refuse(reason: str) -> tuple[None, bytes, str]:
    answer = pb.KVHelloAnswer(accepted=False, reason=reason).SerializeToString()
    return None, frame_bytes(pb.KVFrame(hello_ack=pb.KVHelloAck(answer=answer)).SerializeToString()), reason


def answer_hello(frame: pb.KVFrame, body: bytes, policy: ReceiverPolicy
                 ) -> tuple[PendingPeer | None, bytes, str]:
    """Receiver, step 1: checks a hello (version, layout, certificate, the
    protection its link asks); returns the pending peer (None when refused),
    the bytes to answer with, and why it was refused ("" when not)."""
    if frame.WhichOneof("body") != "hello":
        return _refuse("expected hello")
    h, creds = frame.hello, policy.credentials.pinned() if policy.credentials else None
    reason = _hello_refusal(h, policy)
    if reason:
        return _refuse(reason)
    try:
        peer = _identify(creds, h.certificate, "sender")
    except ProtocolError as exc:
        return _refuse(str(exc))
    required, offered = policy.required(peer.site if peer else None), Protection(h.protection)
    if not offered.satisfies(required):
        src = f"site {peer.site}" if peer else "any site (no certificate to tell which)"
        return _refuse(f"the link from {src} requires {required} protection; the sender offered {offered}")
    share, cipher = KeyShare(), choose_cipher(list(h.ciphers))
    if cipher is None:  # _hello_refusal has refused such an offer
        return _refuse(f"no cipher in common (offered {list(h.ciphers)})")
    answer = pb.KVHelloAnswer(accepted=True, nonce=os.urandom(NONCE_BYTES), key_share=share.public,
                              certificate=creds.certificate if creds else b"", cipher=cipher.value,
                              protection=offered.value).SerializeToString()
    th1 = transcript_1(body, answer)
    keys = share.keys(h.key_share, policy.secret, th1)
    ack = pb.KVHelloAck(answer=answer, signature=creds.sign(signed_message(b"receiver", th1)) if creds else b"",
                        proof=mac_proof(keys.receiver_mac, th1))
    return (PendingPeer(h, th1, keys, cipher, offered, peer, ack),
            frame_bytes(pb.KVFrame(hello_ack=ack).SerializeToString()), "")


def check_auth(frame: pb.KVFrame, policy: ReceiverPolicy, p: PendingPeer) -> str:
    """Receiver, step 2: "" when the sender proved the secret and its
    certificate's key over this handshake; else why not."""
    if frame.WhichOneof("body") != "auth":
        return "expected auth"
    th2 = transcript_2(p.th1, p.ack.signature, p.ack.proof)
    if not hmac.compare_digest(frame.auth.proof, mac_proof(p.keys.sender_mac, th2)):
        return "sender failed authentication (wrong deployment secret?)"
    try:
        _check_signature(policy.credentials, p.hello.certificate, signed_message(b"sender", th2),
                         frame.auth.signature, "sender")
    except ProtocolError as exc:
        return str(exc)
    return ""


def refusal_record(p: PendingPeer, reason: str) -> bytes:
    """The sealed auth_ack that tells a sender (who may hold the keys) why it was refused."""
    writer = RecordWriter(None, p.cipher, p.keys.to_sender, p.protection)
    return writer.seal(pb.KVFrame(auth_ack=pb.KVAuthAck(accepted=False, reason=reason)))[1]


def accept_peer(sock: socket.socket, p: PendingPeer, attacher: PeerAttacher | None, timeout_s: float
                ) -> tuple[Session, MemorySource | None]:
    """Receiver, step 3, for an authenticated sender on a blocking socket:
    reads its sealed offer, attaches its memory if we can, confirms, tunes
    the socket. ProtocolError (after telling the peer) when its memory cannot
    be attached."""
    session = Session(RecordWriter(sock, p.cipher, p.keys.to_sender, p.protection),
                      RecordReader(sock, p.cipher, p.keys.to_receiver, p.protection), p.peer, p.protection)
    sock.settimeout(timeout_s)
    frame, _ = session.reader.recv()
    sock.settimeout(None)
    if frame.WhichOneof("body") != "offer":
        raise ProtocolError("expected the sender's offer")
    source = None
    if attacher is not None and (attacher.same_host or p.protection is Protection.INTEGRITY) \
            and not p.hello.codec and attacher.can_attach(frame.offer):  # a coded connection carries bytes
        try:
            source = attacher.attach(frame.offer)
        except (OSError, ValueError, RuntimeError) as exc:
            session.writer.send(pb.KVFrame(auth_ack=pb.KVAuthAck(
                accepted=False, reason=f"cannot attach the sender's KV: {exc}")))
            raise ProtocolError(f"cannot attach the sender's KV: {exc}") from None
    session.shared, session.codec = source is not None, KVCodec.parse(p.hello.codec)
    session.writer.send(pb.KVFrame(auth_ack=pb.KVAuthAck(accepted=True, shared_memory=session.shared)))
    if p.hello.socket_buffer_bytes:
        tune_socket(sock, min(p.hello.socket_buffer_bytes, MAX_SOCKET_BUFFER))
    return session, source
