"""Blocking-socket framing and the authenticated handshake of the TCP
transport (see proto/kvrelay/v1/kv_wire.proto for the frame sequence)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvrelay.v1 import kv_wire_pb2 as pb

from engine.blocks import ceil_div
from kvtransfer.base import MemorySource

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 3
MAX_FRAME = 1 << 20
"""Largest header frame accepted from an authenticated peer (payloads are not frames)."""
HANDSHAKE_FRAME_MAX = 64 << 10
"""Largest frame accepted before the peer has authenticated (its hello, its
proof): no unauthenticated peer makes a receiver allocate more. (A NIXL hello
still carries the agent metadata, tens of KiB at most.)"""
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


IOV_MAX = 1024
"""Buffers per sendmsg/recvmsg_into call (Linux's limit)."""
IOV_BYTES = 1 << 20
"""Bytes per vectored call: small buffers are batched up to this; a large
one goes alone (each call re-acquires every buffer it is handed)."""


def _batch_end(views: list[memoryview], i: int) -> int:
    end, total = i + 1, len(views[i])
    while end < len(views) and end - i < IOV_MAX and total + len(views[end]) <= IOV_BYTES:
        total += len(views[end])
        end += 1
    return end


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Drops ``n`` transferred bytes from the front of ``views[i:]``; returns the new i."""
    while n:
        k = len(views[i])
        if n >= k:
            n -= k
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Sends every buffer in order with vectored writes (one syscall for up
    to IOV_MAX buffers), straight from their memory."""
    views = [v for v in views if len(v)]
    i = 0
    while i < len(views):
        end = _batch_end(views, i)
        if end == i + 1:
            sock.sendall(views[i])
            i += 1
        else:
            i = _advance(views, i, sock.sendmsg(views[i:end]))


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fills every buffer in order with vectored reads (zero-copy into them)."""
    views = [v for v in views if len(v)]
    i = 0
    while i < len(views):
        end = _batch_end(views, i)
        if end == i + 1:
            recv_exact_into(sock, views[i])
            i += 1
            continue
        n = sock.recvmsg_into(views[i:end])[0]
        if n == 0:
            raise ConnectionError("peer closed the connection")
        i = _advance(views, i, n)


def send_frame(sock: socket.socket, frame: pb.KVFrame) -> None:
    body = frame.SerializeToString()
    sock.sendall(struct.pack("<I", len(body)) + body)


def _frame_length(head: bytes | bytearray, max_bytes: int) -> int:
    """The body length a 4-byte prefix announces; ProtocolError over ``max_bytes`` (before any allocation)."""
    (n,) = struct.unpack_from("<I", head)
    if n > max_bytes:
        raise ProtocolError(f"frame of {n} bytes exceeds the {max_bytes}-byte limit")
    return n


def _decode_frame(body: bytes) -> pb.KVFrame:
    frame = pb.KVFrame()
    try:
        frame.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError has no stable import path
        raise ProtocolError(f"undecodable frame: {exc}") from None
    return frame


def recv_frame(sock: socket.socket) -> pb.KVFrame:
    """One length-prefixed frame of an authenticated peer (at most :data:`MAX_FRAME`)."""
    head = bytearray(4)
    recv_exact_into(sock, memoryview(head))
    body = bytearray(_frame_length(head, MAX_FRAME))
    recv_exact_into(sock, memoryview(body))
    return _decode_frame(bytes(body))


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

    A blocks frame's payload (the plaintext byte stream, whatever its runs of
    blocks are on either side) is sealed in consecutive pieces of PIECE bytes
    (the last may be shorter), each followed by its 16-byte tag. Nonces are
    (frame counter, piece index), so a replayed, reordered or truncated frame
    fails. A piece that lies in one run of blocks is sealed from and opened
    into the KV memory directly; one that spans runs is staged."""

    TAG = 16
    PIECE = 1 << 20

    def __init__(self, secret: bytes, nonce_s: bytes, nonce_r: bytes) -> None:

        key = hmac.new(secret, b"kvrelay-kv-payload-key" + nonce_s + nonce_r, hashlib.sha256).digest()
        self._aes = AESGCM(key)
        self._frames = 0
        self._sealed = memoryview(bytearray(self.PIECE + self.TAG))
        self._plain = memoryview(bytearray(self.PIECE))

    @classmethod
    def sealed_bytes(cls, plain_bytes: int) -> int:
        return plain_bytes + cls.TAG * ceil_div(plain_bytes, cls.PIECE)

    @classmethod
    def _pieces(cls, views: list[memoryview]):
        """Each piece of the stream as the list of view slices it covers."""
        segs, room = [], cls.PIECE
        for v in views:
            off = 0
            while off < len(v):
                k = min(room, len(v) - off)
                segs.append(v[off:off + k])
                off += k
                room -= k
                if not room:
                    yield segs
                    segs, room = [], cls.PIECE
        if segs:
            yield segs

    def next_frame(self) -> int:
        """Counts a frame; call once per blocks frame, also for one discarded unread."""
        self._frames += 1
        return self._frames

    @staticmethod
    def _nonce(frame: int, piece: int) -> bytes:
        return frame.to_bytes(8, "big") + piece.to_bytes(4, "big")

    def send_sealed(self, sock: socket.socket, views: list[memoryview]) -> None:
        """Seals and sends one frame's payload."""
        frame = self.next_frame()
        for i, segs in enumerate(self._pieces(views)):
            if len(segs) == 1:
                plain = segs[0]
            else:
                pos = 0
                for seg in segs:
                    self._plain[pos:pos + len(seg)] = seg
                    pos += len(seg)
                plain = self._plain[:pos]
            n = self._aes.encrypt_into(self._nonce(frame, i), plain, None, self._sealed[:len(plain) + self.TAG])
            sock.sendall(self._sealed[:n])

    def recv_sealed(self, sock: socket.socket, views: list[memoryview]) -> None:
        """Receives one frame's payload, opening each piece into ``views``.
        Raises ProtocolError when a piece was altered (its bytes may already
        be in ``views``: the caller fails the transfer that owns them)."""

        frame = self.next_frame()
        for i, segs in enumerate(self._pieces(views)):
            size = sum(len(seg) for seg in segs)
            recv_exact_into(sock, self._sealed[:size + self.TAG])
            out = segs[0] if len(segs) == 1 else self._plain[:size]
            try:
                self._aes.decrypt_into(self._nonce(frame, i), self._sealed[:size + self.TAG], None, out)
            except InvalidTag:
                raise ProtocolError("encrypted KV payload failed authentication (altered in flight)") from None
            if len(segs) > 1:
                pos = 0
                for seg in segs:
                    seg[:] = self._plain[pos:pos + len(seg)]
                    pos += len(seg)


def client_handshake(sock: socket.socket, secret: bytes, layout_hash: str, offer: pb.KVHello | None = None,
                     encrypt: bool = False, socket_buffer_bytes: int | None = None
                     ) -> tuple[bool, PayloadCipher | None]:
    """Sender side: proves the secret and checks the receiver's proof.

    ``offer`` carries the KVHello fields that let the receiver pull blocks
    itself (shared memory, NIXL). Returns whether it will, and the payload
    cipher when ``encrypt`` was asked for."""
    nonce_s = os.urandom(NONCE_BYTES)
    hello = pb.KVHello(protocol_version=PROTOCOL_VERSION, layout_hash=layout_hash, nonce=nonce_s, encrypt=encrypt,
                       socket_buffer_bytes=socket_buffer_bytes or 0)
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
    """How a receiver maps a sender's memory to pull from (kvtransfer/local.py:
    shared memory, kvtransfer/nixl.py: NIXL)."""

    def can_attach(self, hello: pb.KVHello) -> bool:
        """Cheap checks before authentication: will we pull from this sender?"""

    def attach(self, hello: pb.KVHello) -> MemorySource:
        """After authentication: map or connect the sender's KV memory."""


@dataclass(slots=True)
class PeerHello:
    """A sender's hello that passed the checks, and the receiver's answer to it."""

    hello: pb.KVHello
    nonce_r: bytes
    shared: bool
    """The receiver will pull from the sender's memory (agreed before
    authentication; the memory is touched only after)."""


def parse_frame(buf: bytes | bytearray, max_bytes: int = HANDSHAKE_FRAME_MAX) -> tuple[pb.KVFrame | None, int]:
    """The first complete frame in ``buf`` and the bytes it took; (None, 0)
    while it is incomplete. ProtocolError for a frame over ``max_bytes``
    (before it is buffered) or one that does not decode."""
    if len(buf) < 4:
        return None, 0
    n = _frame_length(buf, max_bytes)
    if len(buf) < 4 + n:
        return None, 0
    return _decode_frame(bytes(buf[4:4 + n])), 4 + n


def answer_hello(frame: pb.KVFrame, secret: bytes, layout_hash: str, attacher: PeerAttacher | None,
                 require_encryption: bool) -> tuple[PeerHello | None, pb.KVFrame]:
    """Receiver side, step 1: checks version, layout and nonce of a hello;
    returns the accepted hello (None when refused) and the frame to answer with."""
    if frame.WhichOneof("body") != "hello":
        return None, pb.KVFrame(hello_ack=pb.KVHelloAck(accepted=False, reason="expected hello"))
    h = frame.hello
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
        return None, pb.KVFrame(hello_ack=pb.KVHelloAck(accepted=False, reason=reason))
    peer = PeerHello(h, os.urandom(NONCE_BYTES), attacher is not None and attacher.can_attach(h))
    return peer, pb.KVFrame(hello_ack=pb.KVHelloAck(
        accepted=True, nonce=peer.nonce_r, proof=_proof(secret, b"R", h.nonce, peer.nonce_r, h),
        shared_memory=peer.shared))


def check_auth(frame: pb.KVFrame, secret: bytes, peer: PeerHello) -> bool:
    """Receiver side, step 2: the sender proved the deployment secret for this handshake."""
    h = peer.hello
    return frame.WhichOneof("body") == "auth" and hmac.compare_digest(
        frame.auth.proof, _proof(secret, b"S", peer.nonce_r, h.nonce, h))


def accept_peer(sock: socket.socket, secret: bytes, peer: PeerHello, attacher: PeerAttacher | None
                ) -> tuple[MemorySource | None, PayloadCipher | None]:
    """Receiver side, step 3, for an authenticated sender: attach its memory
    if agreed, confirm, tune the socket. Returns the attached sender memory
    (or None for bytes on the wire) and the payload cipher when it encrypts.
    ProtocolError (after telling the peer) when its memory cannot be attached."""
    h, peer_kv = peer.hello, None
    if peer.shared:
        try:
            peer_kv = attacher.attach(h)
        except (OSError, ValueError, RuntimeError) as exc:
            send_frame(sock, pb.KVFrame(auth_ack=pb.KVAuthAck(accepted=False,
                                                              reason=f"cannot attach the sender's KV: {exc}")))
            raise ProtocolError(f"cannot attach the sender's KV: {exc}") from None
    send_frame(sock, pb.KVFrame(auth_ack=pb.KVAuthAck(accepted=True)))
    if h.socket_buffer_bytes:
        tune_socket(sock, min(h.socket_buffer_bytes, MAX_SOCKET_BUFFER))
    return peer_kv, (PayloadCipher(secret, h.nonce, peer.nonce_r) if h.encrypt else None)


_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
MAX_SOCKET_BUFFER = 256 << 20
"""Largest socket buffer a sender may ask the receiver for."""
AUTOTUNE_MAX = 4 << 20
"""Linux's default ceiling for TCP buffer autotuning (tcp_wmem/tcp_rmem max)."""


def autotune_max(which: str) -> int:
    """The most this network namespace's TCP autotuning gives a socket
    (net.ipv4.tcp_wmem or tcp_rmem, third field); 0 when it cannot be read."""
    try:
        return int(Path(f"/proc/sys/net/ipv4/tcp_{which}mem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 0


def tune_socket(sock: socket.socket, buffer_bytes: int | None) -> None:
    """No Nagle delay; socket buffers of ``buffer_bytes`` when given (else the
    kernel autotunes). Buffers above net.core.[rw]mem_max need CAP_NET_ADMIN
    (SO_*BUFFORCE). Without it (workers run unprivileged), a namespace whose
    TCP autotuning reaches the size is left to autotune (a fixed SO_*BUF would
    cap it lower); otherwise the kernel caps the buffer and a warning says so."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not buffer_bytes:
        return
    capped = False
    for force, plain, which in ((_SNDBUFFORCE, socket.SO_SNDBUF, "w"), (_RCVBUFFORCE, socket.SO_RCVBUF, "r")):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
        except OSError:
            if autotune_max(which) >= buffer_bytes:
                continue
            sock.setsockopt(socket.SOL_SOCKET, plain, buffer_bytes)
            capped = capped or sock.getsockopt(socket.SOL_SOCKET, plain) // 2 < buffer_bytes  # reported double
    if capped:
        log.warning("socket buffer capped below %d bytes (the link's bandwidth-delay product); "
                    "raise net.core.wmem_max/rmem_max or net.ipv4.tcp_wmem/tcp_rmem, or use more streams",
                    buffer_bytes)


def link_socket_buffer(gbps: float, rtt_ms: float) -> int | None:
    """Socket buffer for a link: its bandwidth-delay product with 25% headroom
    when that exceeds what autotuning reaches, else None (let the kernel tune)."""
    bdp = int(gbps * 1e9 / 8 * rtt_ms / 1e3 * 1.25)
    return bdp if bdp > AUTOTUNE_MAX else None
