"""Blocking-socket I/O of the KV transport: exact reads, the length-prefixed
frames of the handshake, socket tuning (see proto/kvrelay/v1/kv_wire.proto
for the frame sequence)."""

from __future__ import annotations

import fcntl
import logging
import re
import socket
import struct
import termios
from pathlib import Path

from kvrelay.v1 import kv_wire_pb2 as pb

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 6
"""6: a KV codec per connection (KVHello.codec), so a receiver of 5 refuses a sender that might encode."""
HANDSHAKE_FRAME_MAX = 4 << 10
"""Largest frame accepted before the peer has authenticated (its hello with
its certificate, its proofs): no unauthenticated peer makes a receiver
allocate more. Offers of memory (NIXL metadata) come only after, sealed."""
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


def frame_bytes(body: bytes) -> bytes:
    """A handshake frame on the wire: its length, then ``body`` (a serialized KVFrame)."""
    return struct.pack("<I", len(body)) + body


def send_frame(sock: socket.socket, frame: pb.KVFrame) -> bytes:
    """Sends a handshake frame; returns its body (the bytes a transcript covers)."""
    body = frame.SerializeToString()
    sock.sendall(frame_bytes(body))
    return body


def _frame_length(head: bytes | bytearray, max_bytes: int) -> int:
    """The body length a 4-byte prefix announces; ProtocolError over ``max_bytes`` (before any allocation)."""
    (n,) = struct.unpack_from("<I", head)
    if n > max_bytes:
        raise ProtocolError(f"frame of {n} bytes exceeds the {max_bytes}-byte limit")
    return n


def decode_frame(body: bytes) -> pb.KVFrame:
    frame = pb.KVFrame()
    try:
        frame.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError has no stable import path
        raise ProtocolError(f"undecodable frame: {exc}") from None
    return frame


def recv_frame(sock: socket.socket, max_bytes: int = HANDSHAKE_FRAME_MAX) -> tuple[pb.KVFrame, bytes]:
    """One length-prefixed handshake frame and its exact bytes (at most ``max_bytes``)."""
    head = bytearray(4)
    recv_exact_into(sock, memoryview(head))
    body = bytearray(_frame_length(head, max_bytes))
    recv_exact_into(sock, memoryview(body))
    return decode_frame(bytes(body)), bytes(body)


def frame_needs(buf: bytes | bytearray, max_bytes: int = HANDSHAKE_FRAME_MAX) -> int:
    """Bytes still to read for the first frame in ``buf`` to be complete (0: it
    is), so that a reader never takes bytes beyond it. ProtocolError for a
    frame over ``max_bytes``, before it is buffered."""
    if len(buf) < 4:
        return 4 - len(buf)
    return 4 + _frame_length(buf, max_bytes) - len(buf)


def host_id() -> str:
    """Identifies this host (its kernel boot id): equal ids share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


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


_TCP_INFO_HEAD = struct.Struct("5B")
"""struct tcp_info's first bytes: state, ca_state, retransmits, probes, backoff."""


def _tcp_info(sock: socket.socket, field: struct.Struct, at: int) -> tuple | None:
    """The fields ``field`` describes at offset ``at`` of the connection's struct tcp_info; None when
    the kernel does not say (an older kernel's shorter struct, or not a TCP socket)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    except OSError:
        return None
    return field.unpack_from(info, at) if len(info) >= at + field.size else None


def retransmitting(sock: socket.socket) -> bool:
    """Whether the kernel is resending this connection's data on its
    retransmission timer (``tcpi_retransmits`` or ``tcpi_backoff`` > 0): the
    peer has acknowledged nothing for at least one timeout, as after a link
    cut; a healthy connection, however busy, reads 0. False when unknown."""
    got = _tcp_info(sock, _TCP_INFO_HEAD, 0)
    return got is not None and (got[2] > 0 or got[4] > 0)


_TCPI_BYTES_ACKED = struct.Struct("=Q")
_TCPI_BYTES_ACKED_AT = 120
"""Offset of ``tcpi_bytes_acked`` in struct tcp_info (Linux 4.1 on)."""


def acked_bytes(sock: socket.socket) -> int | None:
    """Bytes of this connection the peer's TCP has acknowledged (the SYN
    counts one); None when the kernel does not say. Still readable after the
    connection failed, until the socket is closed."""
    got = _tcp_info(sock, _TCPI_BYTES_ACKED, _TCPI_BYTES_ACKED_AT)
    return None if got is None else int(got[0])


_TCPI_MIN_RTT = struct.Struct("=I")
_TCPI_MIN_RTT_AT = 148
"""Offset of ``tcpi_min_rtt`` (microseconds) in struct tcp_info (Linux 4.6 on)."""


def min_rtt_s(sock: socket.socket) -> float:
    """The least round trip this connection's TCP has measured (its windowed minimum, without the
    queueing a busy link adds), in seconds; 0 when the kernel does not say."""
    got = _tcp_info(sock, _TCPI_MIN_RTT, _TCPI_MIN_RTT_AT)
    return got[0] / 1e6 if got is not None and got[0] != 0xFFFFFFFF else 0.0


_TCPI_CHRONO = struct.Struct("=QQQ")
_TCPI_CHRONO_AT = 168
"""Offset of ``tcpi_busy_time`` (their total), ``tcpi_rwnd_limited`` and ``tcpi_sndbuf_limited`` (microseconds) in
struct tcp_info (Linux 4.10 on)."""


def network_busy_us(sock: socket.socket) -> int | None:
    """Microseconds this connection had data in flight and the network set its pace: its TCP's busy
    time less the time the receiver's window limited it. (The send-buffer-limited time stays in: then
    the whole buffer is in flight and the path's acknowledgements pace it.) The kernel counts in
    scheduler ticks, 1-4 ms. None when the kernel does not say."""
    got = _tcp_info(sock, _TCPI_CHRONO, _TCPI_CHRONO_AT)
    return None if got is None else int(got[0] - got[1])


def written_mark(sock: socket.socket) -> int | None:
    """Where the next byte written to ``sock`` will sit, counted as
    :func:`acked_bytes` counts: acknowledged bytes plus those still queued
    (SIOCOUTQ). Once ``acked_bytes`` exceeds it, the peer has received some
    of what was written after the mark was taken. None when unknown."""
    acked = acked_bytes(sock)
    if acked is None:
        return None
    try:
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return None
    return acked + queued


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
