"""The receiver every transport builds on: a listener thread, and per
connection a thread that checks the handshake (kvtransfer/wire.py), then
lands each blocks frame in the reserved blocks: ``recv_into`` straight into
their memory, or a pull from the sender's memory (a ``MemorySource`` its
attachers map: shared memory, NIXL). A verifier thread per connection checks
CRC32C per block while the next frame arrives. Bytes for a transfer that is
unknown or was cancelled are read into scratch memory and dropped: a freed
reservation is never written."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.v1 import kv_wire_pb2 as pb

from engine.kv_cache import KVCache
from kvtransfer.base import (
    KVReceiver,
    MemorySource,
    TransferHandle,
    TransferResult,
    TransferState,
)
from kvtransfer.config import TransferConfig
from kvtransfer.gate import GateConfig, HandshakeGate
from kvtransfer.handles import StateHandle
from kvtransfer.memory import KVBytes, block_crcs, coalesce
from kvtransfer.wire import (
    PayloadCipher,
    PeerAttacher,
    PeerHello,
    ProtocolError,
    accept_peer,
    recv_exact_into,
    recv_frame,
    recv_views,
    send_frame,
    tune_socket,
)

log = logging.getLogger(__name__)

INLINE_VERIFY_BYTES = 1 << 20
"""Frames up to this size are verified on the receiving thread (a thread
hop costs more than summing them); larger ones on the verifier thread."""


@dataclass(slots=True)
class _Incoming:
    handle: StateHandle
    block_ids: list[int]
    need: int
    landed: set = field(default_factory=set)
    nbytes: int = 0
    started: float = 0.0
    done: pb.KVDone | None = None
    done_conn: _Conn | None = None
    acked: bool = False
    writers: dict = field(default_factory=dict)
    """Connections writing into this reservation's blocks now (conn -> count)."""
    cond: threading.Condition = field(default_factory=threading.Condition)

    def enter(self, conn: _Conn) -> bool:
        """A connection starts writing into the blocks; False once failed."""
        with self.cond:
            if self.handle.poll() is TransferState.FAILED:
                return False
            self.writers[conn] = self.writers.get(conn, 0) + 1
            return True

    def leave(self, conn: _Conn) -> None:
        with self.cond:
            self.writers[conn] -= 1
            if not self.writers[conn]:
                del self.writers[conn]
            self.cond.notify_all()


class _Attach:
    """The handshake's PeerAttacher for one connection: the first of the
    receiver's attachers that accepts the sender's offer maps its memory."""

    def __init__(self, attachers: Sequence[PeerAttacher]) -> None:
        self.attachers = attachers
        self.chosen: PeerAttacher | None = None

    def can_attach(self, hello: pb.KVHello) -> bool:
        self.chosen = next((a for a in self.attachers if a.can_attach(hello)), None)
        return self.chosen is not None

    def attach(self, hello: pb.KVHello) -> MemorySource:
        return self.chosen.attach(hello)


class _Conn:
    """One accepted connection; ``send`` may be called from other threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.transfers: set[str] = set()
        self.source: MemorySource | None = None
        """The sender's memory, when it offered it and we pull from it."""
        self.cipher: PayloadCipher | None = None
        """When the sender encrypts its payloads."""
        self.verify: queue.SimpleQueue = queue.SimpleQueue()
        """Frames whose bytes landed, for the verifier thread to checksum."""

    def send(self, frame: pb.KVFrame) -> None:
        with self.lock:
            try:
                send_frame(self.sock, frame)
            except OSError:
                pass

    def abort(self) -> None:
        """Makes a receive blocked on this connection return at once."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class ChannelReceiver(KVReceiver):
    """Receives KV into reserved blocks over authenticated connections: bytes
    on the socket, or pulled from a sender's memory through the first of
    ``attachers`` that accepts the sender's offer."""

    def __init__(self, cache: KVCache, host: str = "127.0.0.1", cfg: TransferConfig | None = None,
                 attachers: Sequence[PeerAttacher] = ()) -> None:
        self.cache = cache
        self.mem = KVBytes(cache)
        self.cfg = cfg or TransferConfig()
        self.attachers = tuple(attachers)
        """How we pull from senders that offer their memory, in order of preference."""
        self.layout_hash = cache.layout.compat_hash()
        self._expected: dict[str, _Incoming] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._listener = socket.create_server((host, 0), backlog=128)
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self.bytes_received = 0
        self._refused_after_auth = 0
        self._conns: set[_Conn] = set()
        self.gate = HandshakeGate(
            self._listener, GateConfig(self.cfg.secret, self.layout_hash, self.cfg.encrypt, self.cfg.connect_timeout_s),
            lambda: _Attach(self.attachers), self._on_peer)
        """Every connection's handshake until the sender is authenticated (one thread for all)."""

    def expect(self, transfer_id: str, block_ids: list[int]) -> TransferHandle:
        h = StateHandle(transfer_id)
        h.advance(TransferState.WAITING)
        layers = self.cache.layout.num_layers
        with self._lock:
            self._expected[transfer_id] = _Incoming(h, list(block_ids), 2 * layers * len(block_ids),
                                                    started=time.perf_counter())
        return h

    def cancel(self, transfer_id: str) -> None:
        """Fails the transfer and returns once nothing writes into its blocks
        any more: a connection still writing is cut after a short grace."""
        with self._lock:
            inc = self._expected.pop(transfer_id, None)
        if inc is None:
            return
        inc.handle.fail("cancelled by the receiver")
        with inc.cond:
            if inc.cond.wait_for(lambda: not inc.writers, 1.0):
                return
            for conn in inc.writers:
                conn.abort()
            inc.cond.wait_for(lambda: not inc.writers, self.cfg.connect_timeout_s)

    def close(self) -> None:
        self._closed.set()
        self.gate.close()
        self._listener.close()
        for conn in list(self._conns):
            conn.abort()

    @property
    def refused(self) -> int:
        """Connections refused at the handshake (by the gate, or their memory could not be attached)."""
        return self.gate.refused + self._refused_after_auth

    def _on_peer(self, sock: socket.socket, peer: PeerHello, attacher: PeerAttacher | None) -> None:
        """The gate authenticated a sender: serve it on a thread of its own."""
        threading.Thread(target=self._serve, args=(sock, peer, attacher), name="kv-recv", daemon=True).start()

    def _accept(self, conn: _Conn, peer: PeerHello, attacher: PeerAttacher | None) -> bool:
        """Attaches an authenticated sender's memory (if agreed) and confirms; False (logged) when it cannot."""
        try:
            tune_socket(conn.sock, self.cfg.socket_buffer_bytes)
            conn.source, conn.cipher = accept_peer(conn.sock, self.cfg.secret, peer, attacher)
            return True
        except (ProtocolError, OSError) as exc:
            self._refused_after_auth += 1
            log.warning("refused KV connection: %s", exc)
            return False

    def _serve(self, sock: socket.socket, peer: PeerHello, attacher: PeerAttacher | None) -> None:
        conn = _Conn(sock)
        self._conns.add(conn)
        try:
            if not self._accept(conn, peer, attacher):
                return
            threading.Thread(target=self._verify_loop, args=(conn,), name="kv-verify", daemon=True).start()
            while not self._closed.is_set():
                frame = recv_frame(sock)
                kind = frame.WhichOneof("body")
                if kind == "blocks":
                    self._on_blocks(conn, frame.blocks)
                elif kind == "done":
                    self._on_done(conn, frame.done)
                else:
                    raise ProtocolError(f"unexpected {kind!r} frame")
        except (OSError, ConnectionError, ProtocolError) as exc:
            for tid in list(conn.transfers):
                inc = self._expected.get(tid)
                if inc is not None:
                    inc.handle.fail(f"sender connection lost ({exc})")
                    self._maybe_complete(tid, inc)
        finally:
            conn.verify.put(None)
            self._conns.discard(conn)
            sock.close()

    def _discard(self, conn: _Conn, n: int) -> None:
        """Reads and drops a payload that must not land in any block."""
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, len(scratch))
            recv_exact_into(conn.sock, scratch[:k])
            n -= k
        if conn.cipher is not None:
            conn.cipher.next_frame()

    def _frame_shape(self, conn: _Conn, hdr: pb.KVBlocks) -> tuple[range, bool, bool]:
        """The frame's layers, whether we pull its blocks and whether its
        payload is sealed; ProtocolError when the frame contradicts itself."""
        layers = range(hdr.layer, hdr.layer + max(1, hdr.num_layers))
        runs = len(layers) * 2 * hdr.count
        pulled = len(hdr.src_blocks) > 0
        sealed = conn.cipher is not None and not pulled
        if pulled and (conn.source is None or len(hdr.src_blocks) != hdr.count
                       or max(hdr.src_blocks) >= conn.source.num_blocks):
            raise ProtocolError("shared-memory blocks frame without a valid shared KV mapping")
        if pulled:
            payload = 0
        elif sealed:
            payload = PayloadCipher.sealed_bytes(runs * self.cache.layout.block_bytes)
        else:
            payload = runs * self.cache.layout.block_bytes
        if hdr.payload_bytes != payload or len(hdr.crc32c) != (0 if sealed else runs):
            raise ProtocolError(f"blocks frame of {hdr.payload_bytes} bytes and {len(hdr.crc32c)} checksums "
                                f"for {hdr.count} blocks x {hdr.num_layers} layers")
        return layers, pulled, sealed

    def _outside(self, inc: _Incoming, hdr: pb.KVBlocks, layers: range) -> str:
        """Why the frame's blocks lie outside the reservation or the model; "" when inside."""
        if layers.stop > self.cache.layout.num_layers or hdr.count == 0 or hdr.first + hdr.count > len(inc.block_ids):
            return f"blocks [{hdr.first}, {hdr.first + hdr.count}) of layers {layers.start}-{layers.stop - 1} " \
                   "outside the reservation or the model"
        return ""

    def _on_blocks(self, conn: _Conn, hdr: pb.KVBlocks) -> None:
        inc = self._expected.get(hdr.transfer_id)
        layers, pulled, sealed = self._frame_shape(conn, hdr)
        bad = self._outside(inc, hdr, layers) if inc is not None else ""
        if inc is None or bad or not inc.enter(conn):
            self._discard(conn, hdr.payload_bytes)
            if inc is not None and bad:
                inc.handle.fail(bad)
                self._maybe_complete(hdr.transfer_id, inc)
            return
        dest = inc.block_ids[hdr.first:hdr.first + hdr.count]
        views = [self.mem.run(layer, kind, first_id, n) for layer in layers for kind in (0, 1)
                 for _, first_id, n in coalesce(dest)]
        conn.transfers.add(hdr.transfer_id)
        try:
            inc.handle.advance(TransferState.TRANSFERRING)
            if pulled:
                conn.source.pull(layers, list(hdr.src_blocks), dest)
            elif sealed:
                conn.cipher.recv_sealed(conn.sock, views)
            else:
                recv_views(conn.sock, views)
        finally:
            inc.leave(conn)
        if sealed:  # the AEAD tags authenticated every byte
            self._land(inc, hdr, layers)
        elif hdr.payload_bytes <= INLINE_VERIFY_BYTES:
            self._verify(inc, hdr, layers, views, dest)
        else:
            conn.verify.put((inc, hdr, layers, views, dest))

    def _verify_loop(self, conn: _Conn) -> None:
        """Checksums landed frames off the receiving thread, so the next
        frame's bytes arrive while this one is summed."""
        for item in iter(conn.verify.get, None):
            self._verify(*item)

    def _verify(self, inc: _Incoming, hdr: pb.KVBlocks, layers: range, views: list[memoryview],
                dest: list[int]) -> None:
        crcs = block_crcs(views, self.cache.layout.block_bytes)
        bad = [i for i, (a, b) in enumerate(zip(crcs, hdr.crc32c)) if a != b]
        if bad:
            bad_blocks = sorted({dest[i % hdr.count] for i in bad})
            inc.handle.fail(f"checksum mismatch in layers {layers.start}-{layers.stop - 1} of "
                            f"{len(bad_blocks)} block(s)", bad_blocks)
            self._maybe_complete(hdr.transfer_id, inc)
        else:
            self._land(inc, hdr, layers)

    def _land(self, inc: _Incoming, hdr: pb.KVBlocks, layers: range) -> None:
        with inc.cond:
            for layer in layers:
                for kind in (0, 1):
                    for i in range(hdr.first, hdr.first + hdr.count):
                        inc.landed.add((layer, kind, i))
            inc.nbytes += hdr.payload_bytes
        self.bytes_received += hdr.payload_bytes
        self._maybe_complete(hdr.transfer_id, inc)

    def _on_done(self, conn: _Conn, done: pb.KVDone) -> None:
        inc = self._expected.get(done.transfer_id)
        if inc is None:
            conn.send(pb.KVFrame(done_ack=pb.KVDoneAck(transfer_id=done.transfer_id, ok=False,
                                                       reason="no such reservation (expired or cancelled)")))
            return
        inc.done, inc.done_conn = done, conn
        self._maybe_complete(done.transfer_id, inc)

    def _maybe_complete(self, tid: str, inc: _Incoming) -> None:
        """Answers the sender's done once every block landed, or the transfer failed."""
        with inc.cond:
            if inc.done is None or inc.acked:
                return
            state = inc.handle.poll()
            if state is not TransferState.FAILED and len(inc.landed) < inc.need:
                return
            inc.acked = True
        if state is not TransferState.FAILED:
            inc.handle.complete(TransferResult(inc.done.first_token_id, inc.done.first_logprob, inc.nbytes,
                                               time.perf_counter() - inc.started))
            with self._lock:  # done: later frames for it are dropped unread
                if self._expected.get(tid) is inc:
                    del self._expected[tid]
        err = inc.handle.failure()
        inc.done_conn.send(pb.KVFrame(done_ack=pb.KVDoneAck(transfer_id=tid, ok=err is None,
                                                            reason=err.reason if err else "")))
