"""The receiver's gate: every KV connection's handshake, up to the moment
the sender has proved itself (kvtransfer/handshake.py), in one thread.

Before authentication a peer costs a socket and a small buffer, nothing
else: its frames may be at most :data:`~kvtransfer.wire.HANDSHAKE_FRAME_MAX`
bytes (refused before they are buffered; nothing past a frame is read),
the whole handshake has one deadline however the bytes trickle in, at
most ``max_pending`` connections wait at once and at most
``max_pending_per_source`` from one address (more are closed on accept:
one host cannot fill the gate). A hello must carry a stamp made with the
deployment secret, be recent and bring a nonce not seen in the last
:data:`~kvtransfer.handshake.HELLO_WINDOW_S`: checked with a MAC before any
certificate, key exchange or signature, so neither a peer without the
secret nor a replayed hello makes the receiver do that work. No thread is
started for a peer that has not authenticated; an authenticated one is
handed to ``on_peer`` (which attaches its memory, confirms, and serves it
on a thread of its own). So a flood of unauthenticated connections cannot
hold threads, memory or file descriptors beyond the budget, and a real
sender gets through meanwhile."""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.kvtransfer.handshake import (
    HELLO_WINDOW_S,
    PendingPeer,
    ReceiverPolicy,
    answer_hello,
    check_auth,
    early_refusal,
    refusal_answer,
    refusal_record,
)
from kvrelay.kvtransfer.wire import ProtocolError, decode_frame, frame_needs
from kvrelay.v1 import kv_wire_pb2 as pb

log = logging.getLogger(__name__)

MAX_PENDING = 4096
"""Connections in their handshake at once; more are closed on accept."""
MAX_PENDING_PER_SOURCE = 64
"""Connections in their handshake at once from one address; more are closed on accept."""
MAX_NONCES = 1 << 16
"""Hello nonces remembered (each for HELLO_WINDOW_S); when full, new hellos are refused until some expire."""
TICK_S = 0.1
"""How often deadlines are checked."""


@dataclass(slots=True)
class _Pending:
    sock: socket.socket
    deadline: float
    source: str = ""
    """The peer's address (its pending connections are counted per address)."""
    buf: bytearray = field(default_factory=bytearray)
    peer: PendingPeer | None = None
    """Set once the hello was accepted (the proofs come next)."""


@dataclass(frozen=True, slots=True)
class GateConfig:
    """What a gate checks (the policy) and its limits."""

    policy: ReceiverPolicy
    timeout_s: float
    """Deadline of a whole handshake, from accept."""
    max_pending: int = MAX_PENDING
    max_pending_per_source: int = MAX_PENDING_PER_SOURCE


class HandshakeGate:
    """Runs handshakes of connections on ``listener`` until :meth:`close`."""

    def __init__(self, listener: socket.socket, cfg: GateConfig,
                 on_peer: Callable[[socket.socket, PendingPeer], None]) -> None:
        self.listener, self.cfg = listener, cfg
        self.on_peer = on_peer
        self.refused = 0
        """Connections refused (bad handshake, deadline, or the gate full)."""
        self._pending: dict[int, _Pending] = {}
        self._per_source: Counter[str] = Counter()
        self._nonces: set[bytes] = set()
        self._nonce_expiry: deque[tuple[float, bytes]] = deque()
        """Nonces of accepted hellos, oldest first, with when each may be forgotten."""
        self._closed = threading.Event()
        self._sel = selectors.DefaultSelector()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._run, name="kv-gate", daemon=True)
        self.thread.start()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._closed.set()
        self.thread.join(5.0)

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                for key, _ in self._sel.select(TICK_S):
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._readable(self._pending.get(key.fd))
                self._expire(time.monotonic())
        finally:
            for p in list(self._pending.values()):
                self._drop(p, None)
            self._sel.close()

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, then deadlines get their turn
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            source = _source(sock)
            if len(self._pending) >= self.cfg.max_pending \
                    or self._per_source[source] >= self.cfg.max_pending_per_source:
                self.refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            p = _Pending(sock, time.monotonic() + self.cfg.timeout_s, source)
            self._pending[sock.fileno()] = p
            self._per_source[source] += 1
            self._sel.register(sock, selectors.EVENT_READ)

    def _expire(self, now: float) -> None:
        for p in [p for p in self._pending.values() if now > p.deadline]:
            self._drop(p, f"no complete handshake within {self.cfg.timeout_s:g} s")
        while self._nonce_expiry and self._nonce_expiry[0][0] < now:
            self._nonces.discard(self._nonce_expiry.popleft()[1])

    def _release(self, p: _Pending) -> None:
        """``p`` no longer waits in the gate: it stops counting against its address."""
        if self._pending.pop(p.sock.fileno(), None) is not None:
            self._per_source[p.source] -= 1
            if self._per_source[p.source] <= 0:
                del self._per_source[p.source]
        self._sel.unregister(p.sock)

    def _replayed(self, nonce: bytes) -> str:
        """"" when ``nonce`` is new (it is remembered from now on); else why the hello is refused."""
        if nonce in self._nonces:
            return "replayed hello (its nonce was seen before)"
        if len(self._nonces) >= MAX_NONCES:
            return "too many handshakes lately; try again shortly"
        self._nonces.add(nonce)
        self._nonce_expiry.append((time.monotonic() + 2 * HELLO_WINDOW_S, nonce))
        return ""

    def _drop(self, p: _Pending, reason: str | None, answer: bytes = b"") -> None:
        """Ends a pending connection (refused when ``reason``), telling the peer ``answer`` first."""
        self._release(p)
        if answer:
            _send_small(p.sock, answer)
        p.sock.close()
        if reason is not None:
            self.refused += 1
            log.warning("refused KV connection: %s", reason)

    def _readable(self, p: _Pending | None) -> None:
        if p is None:
            return
        try:
            chunk = p.sock.recv(frame_needs(p.buf))  # never beyond this frame: the sealed offer follows the proofs
        except ProtocolError as exc:
            self._drop(p, str(exc))
            return
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(p, f"connection failed during the handshake ({exc})")
            return
        if not chunk:
            self._drop(p, "peer closed the connection during the handshake")
            return
        p.buf += chunk
        try:
            if frame_needs(p.buf) == 0:
                body = bytes(p.buf[4:])
                p.buf.clear()
                self._step(p, decode_frame(body), body)
        except ProtocolError as exc:
            self._drop(p, str(exc))

    def _step(self, p: _Pending, frame: pb.KVFrame, body: bytes) -> None:
        """One complete frame of a pending handshake: the hello, then the proofs."""
        policy = self.cfg.policy
        if p.peer is None:
            reason = early_refusal(frame, policy.secret, time.time()) or self._replayed(frame.hello.nonce)
            if reason:  # a MAC's worth of work: no certificate, key exchange or signature yet
                self._drop(p, reason, refusal_answer(reason))
                return
            peer, answer, reason = answer_hello(frame, body, policy)
            if peer is None:
                self._drop(p, reason, answer)
                return
            p.peer = peer
            _send_small(p.sock, answer)
            return
        reason = check_auth(frame, policy, p.peer)
        if reason:
            self._drop(p, reason, refusal_record(p.peer, "authentication failed"))
            return
        self._release(p)
        p.sock.setblocking(True)
        self.on_peer(p.sock, p.peer)


def _source(sock: socket.socket) -> str:
    """The address a connection comes from ("" when the socket no longer knows)."""
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return ""


def _send_small(sock: socket.socket, data: bytes) -> None:
    """Sends a handshake answer (at most a few KiB: it fits an empty socket
    buffer) on a non-blocking socket; a peer that does not read is its own loss."""
    try:
        sock.send(data)
    except OSError:
        pass
