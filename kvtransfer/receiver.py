"""The receiver every transport builds on: a gate thread runs every
handshake (kvtransfer/gate.py, kvtransfer/handshake.py); each authenticated
connection gets a thread that opens its records (kvtransfer/record.py) and
lands each blocks frame in the reserved blocks: decrypted (or MAC-checked)
straight into their memory, or pulled from the sender's memory (a
``MemorySource`` its attachers map: shared memory, NIXL) and checked against
the MAC of each run in the authenticated header, on a verifier thread for
large frames. A block counts as landed only once its frame verified; a record that
fails ends the connection and fails every transfer on it. Payloads for a
transfer that is unknown or was cancelled are read into scratch memory (their
tags still checked) and dropped: a freed reservation is never written."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import (
    KVCodec,
    KVReceiver,
    MemorySource,
    TransferHandle,
    TransferResult,
    TransferState,
)
from kvrelay.kvtransfer.coded import codecs_for, coded_bytes, decode_planes
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.gate import GateConfig, HandshakeGate
from kvrelay.kvtransfer.handles import StateHandle
from kvrelay.kvtransfer.handshake import (
    PeerAttacher,
    PendingPeer,
    ReceiverPolicy,
    Session,
    accept_peer,
)
from kvrelay.kvtransfer.memory import coalesce, paired_runs
from kvrelay.kvtransfer.protection import Protection
from kvrelay.kvtransfer.record import RecordError
from kvrelay.kvtransfer.staging import DeviceKV, kv_memory
from kvrelay.kvtransfer.wire import ProtocolError, tune_socket
from kvrelay.v1 import kv_wire_pb2 as pb

log = logging.getLogger(__name__)

INLINE_VERIFY_BYTES = 1 << 20
"""Frames up to this size are verified on the receiving thread (a thread
hop costs more than summing them); larger ones on the verifier thread."""


@dataclass(slots=True)
class _Incoming:
    handle: StateHandle
    block_ids: list[int]
    landed: bytearray
    """One byte per (layer, K/V, block of the reservation): 1 once it landed and verified."""
    missing: int
    """Zeros left in ``landed``."""
    nbytes: int = 0
    started: float = 0.0
    sender: str = ""
    """The only sender (``site/prefill/index``) whose frames it takes; "" any authenticated one."""
    done: pb.KVDone | None = None
    done_conn: _Conn | None = None
    acked: bool = False
    writers: dict = field(default_factory=dict)
    """Connections writing into this reservation's blocks now (conn -> count)."""
    carriers: set = field(default_factory=set)
    """Connections that carried blocks of it (each remembers it in ``_Conn.transfers`` until it ends)."""
    cond: threading.Condition = field(default_factory=threading.Condition)

    def takes_from(self, conn: _Conn) -> bool:
        """Whether ``conn``'s sender may write into this reservation (the one it names, when it names one
        and senders have certificates; without them every sender holds the same secret)."""
        peer = conn.session.peer if conn.session is not None else None
        return not self.sender or peer is None or peer.path == self.sender

    def enter(self, conn: _Conn) -> bool:
        """A connection starts writing into the blocks; False once failed."""
        with self.cond:
            if self.handle.poll() is TransferState.FAILED:
                return False
            self.writers[conn] = self.writers.get(conn, 0) + 1
            self.carriers.add(conn)
            return True

    def forget(self, tid: str) -> None:
        """It has ended: the connections that carried it stop remembering it (a pooled
        connection carries transfer after transfer; it must not keep them all)."""
        with self.cond:
            carriers = list(self.carriers)
        for conn in carriers:
            if conn.transfers.get(tid) is self:
                conn.transfers.pop(tid, None)

    def leave(self, conn: _Conn) -> None:
        with self.cond:
            self.writers[conn] -= 1
            if not self.writers[conn]:
                del self.writers[conn]
            self.cond.notify_all()


class _Attach:
    """The handshake's PeerAttacher for one connection: the first of the
    receiver's attachers that accepts the sender's offer maps its memory
    (only same-host ones unless ``remote_ok``: an integrity link)."""

    def __init__(self, attachers: Sequence[PeerAttacher], remote_ok: bool) -> None:
        self.attachers = [a for a in attachers if a.same_host or remote_ok]
        self.same_host = True
        """The filter above already applied the rule accept_peer checks."""
        self.chosen: PeerAttacher | None = None

    def can_attach(self, offer: pb.KVOffer) -> bool:
        self.chosen = next((a for a in self.attachers if a.can_attach(offer)), None)
        return self.chosen is not None

    def attach(self, offer: pb.KVOffer) -> MemorySource:
        if self.chosen is None:  # the handshake attaches only an offer can_attach accepted
            raise RuntimeError("attach before can_attach accepted the offer")
        return self.chosen.attach(offer)


class _Conn:
    """One accepted connection; ``send`` may be called from other threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.transfers: dict[str, _Incoming | None] = {}
        """Transfer id -> the expectation this connection carried blocks for (a loss of the
        connection fails that one, not a later expectation of the same id)."""
        self.session: Session | None = None
        """Its records each way, once the handshake completed."""
        self.source: MemorySource | None = None
        """The sender's memory, when it offered it and we pull from it."""
        self.verify: queue.SimpleQueue = queue.SimpleQueue()
        """Pulled frames, for the verifier thread to check against their MACs."""

    @property
    def live(self) -> Session:
        """The session, once the handshake completed (nothing is received or sent before)."""
        if self.session is None:
            raise RuntimeError("the KV connection's handshake has not completed")
        return self.session

    def send(self, frame: pb.KVFrame) -> None:
        with self.lock:
            try:
                self.live.writer.send(frame)
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
        self.mem = kv_memory(cache)
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
        self.wrong_sender = 0
        """Frames refused because their reservation names another sender."""
        self._conns: set[_Conn] = set()
        self.cfg.check_authenticating()
        policy = ReceiverPolicy(self.cfg.secret, self.layout_hash, self.cfg.credentials, self.cfg.required,
                                codecs_for(cache.layout))
        limits = GateConfig(policy, self.cfg.connect_timeout_s, self.cfg.max_pending_handshakes,
                            self.cfg.max_pending_per_source)
        self.gate = HandshakeGate(self._listener, limits, self._on_peer)
        """Every connection's handshake until the sender is authenticated (one thread for all)."""

    def expect(self, transfer_id: str, block_ids: list[int], sender: str = "") -> TransferHandle:
        h = StateHandle(transfer_id)
        h.advance(TransferState.WAITING)
        layers, kinds = self.cache.layout.num_layers, self.cache.layout.kinds
        with self._lock:
            self._expected[transfer_id] = _Incoming(h, list(block_ids), bytearray(kinds * layers * len(block_ids)),
                                                    kinds * layers * len(block_ids),
                                                    started=time.perf_counter(), sender=sender)
        return h

    def cancel(self, transfer_id: str) -> None:
        """Fails the transfer and returns once nothing writes into its blocks
        any more: a connection still writing is cut after a short grace."""
        with self._lock:
            inc = self._expected.pop(transfer_id, None)
        if inc is None:
            return
        inc.forget(transfer_id)
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
    def connections(self) -> int:
        """Sender connections open now (authenticated, or in their handshake)."""
        return len(self._conns)

    @property
    def refused(self) -> int:
        """Connections refused at the handshake (by the gate, or their memory could not be attached)."""
        return self.gate.refused + self._refused_after_auth

    def _on_peer(self, sock: socket.socket, peer: PendingPeer) -> None:
        """The gate authenticated a sender: serve it on a thread of its own."""
        threading.Thread(target=self._serve, args=(sock, peer), name="kv-recv", daemon=True).start()

    def _accept(self, conn: _Conn, peer: PendingPeer) -> bool:
        """Reads the sender's sealed offer, attaches its memory if we can, and
        confirms; False (logged) when it cannot."""
        try:
            tune_socket(conn.sock, self.cfg.socket_buffer_bytes)
            attach = _Attach(self.attachers, remote_ok=peer.protection is Protection.INTEGRITY)
            conn.session, conn.source = accept_peer(conn.sock, peer, attach, self.cfg.connect_timeout_s)
            return True
        except (ProtocolError, OSError) as exc:
            self._refused_after_auth += 1
            log.warning("refused KV connection: %s", exc)
            return False

    def _serve(self, sock: socket.socket, peer: PendingPeer) -> None:
        conn = _Conn(sock)
        self._conns.add(conn)
        try:
            if not self._accept(conn, peer):
                return
            threading.Thread(target=self._verify_loop, args=(conn,), name="kv-verify", daemon=True).start()
            while not self._closed.is_set():
                frame, payload = conn.live.reader.recv()
                kind = frame.WhichOneof("body")
                if kind == "blocks":
                    self._on_blocks(conn, frame.blocks, payload)
                elif kind == "done" and not payload:
                    self._on_done(conn, frame.done)
                else:
                    raise ProtocolError(f"unexpected {kind!r} frame")
        except (OSError, ConnectionError, ProtocolError) as exc:
            if conn.session is not None and isinstance(exc, ProtocolError):  # tell the sender why
                conn.send(pb.KVFrame(done_ack=pb.KVDoneAck(ok=False, reason=f"stream refused: {exc}")))
            who = conn.session.peer if conn.session and conn.session.peer else "the sender"
            if isinstance(exc, RecordError) and exc.transfer_id:
                named = self._expected.get(exc.transfer_id)
                if named is not None and named.takes_from(conn):  # another sender's loss fails nothing of it
                    conn.transfers.setdefault(exc.transfer_id, named)
            for tid, seen in list(conn.transfers.items()):
                inc = self._expected.get(tid)
                if inc is not None and inc is seen:
                    inc.handle.fail(f"KV connection from {who} lost: {exc}")
                    self._maybe_complete(tid, inc)
        finally:
            conn.verify.put(None)
            self._conns.discard(conn)
            sock.close()

    def _frame_shape(self, conn: _Conn, hdr: pb.KVBlocks, payload: int) -> tuple[range, bool]:
        """The frame's layers and whether we pull its blocks; ProtocolError
        when the (authenticated) frame contradicts itself or the model."""
        layers = range(hdr.layer, hdr.layer + max(1, hdr.num_layers))
        runs = len(layers) * self.cache.layout.kinds * hdr.count
        pulled = len(hdr.src_blocks) > 0
        codec = conn.live.codec
        if hdr.codec != ("" if codec is KVCodec.NONE else codec.value) or (pulled and codec is not KVCodec.NONE):
            raise ProtocolError(f"a blocks frame under codec {hdr.codec or 'none'!r} on a connection that agreed "
                                f"on {codec.value!r}{' (pulled)' if pulled else ''}")
        if pulled and (conn.source is None or len(hdr.src_blocks) != hdr.count
                       or max(hdr.src_blocks) >= conn.source.num_blocks):
            raise ProtocolError("shared-memory blocks frame without a valid shared KV mapping")
        want = 0 if pulled else runs * self.cache.layout.block_bytes if codec is KVCodec.NONE \
            else coded_bytes(codec, self.cache.layout, hdr.count, len(layers))
        if hdr.payload_bytes != payload or payload != want or (hdr.pulled_tags and not pulled):
            raise ProtocolError(f"blocks frame of {payload} bytes and {len(hdr.pulled_tags)} bytes of tags "
                                f"for {hdr.count} blocks x {hdr.num_layers} layers")
        if layers.stop > self.cache.layout.num_layers or hdr.count == 0:
            raise ProtocolError(f"blocks frame for layers {layers.start}-{layers.stop - 1} of a "
                                f"{self.cache.layout.num_layers}-layer model, {hdr.count} blocks")
        return layers, pulled

    def _outside(self, inc: _Incoming, hdr: pb.KVBlocks) -> str:
        """Why the frame's blocks lie outside the reservation; "" when inside."""
        if hdr.first + hdr.count > len(inc.block_ids):
            return f"blocks [{hdr.first}, {hdr.first + hdr.count}) outside the reservation of {len(inc.block_ids)}"
        return ""

    def _on_blocks(self, conn: _Conn, hdr: pb.KVBlocks, payload: int) -> None:
        inc = self._expected.get(hdr.transfer_id)
        try:
            layers, pulled = self._frame_shape(conn, hdr, payload)
        except ProtocolError as exc:  # authenticated, so the transfer it names is this sender's to fail
            raise RecordError(str(exc), hdr.transfer_id) from None
        if inc is not None and not inc.takes_from(conn):  # dropped: the reservation is not its to write
            self._refuse_sender(conn, hdr.transfer_id, inc)
            inc = None
        bad = self._outside(inc, hdr) if inc is not None else ""
        if inc is None or bad or not inc.enter(conn):
            conn.live.reader.skip_payload()
            if inc is not None and bad:
                inc.handle.fail(bad)
                self._maybe_complete(hdr.transfer_id, inc)
            return
        dest = inc.block_ids[hdr.first:hdr.first + hdr.count]
        seq = conn.live.reader.last_seq
        conn.transfers[hdr.transfer_id] = inc
        try:
            inc.handle.advance(TransferState.TRANSFERRING)
            if pulled:
                if conn.source is None:  # _frame_shape refused it already
                    raise ProtocolError("shared-memory blocks frame without a valid shared KV mapping")
                conn.source.pull(layers, list(hdr.src_blocks), dest)
                # one view per run consecutive at both ends: what the sender tagged
                views = self._views(layers, dest, paired_runs(list(hdr.src_blocks), dest))
            elif conn.live.codec is not KVCodec.NONE:
                self._receive_coded(conn, layers, dest, payload)
            else:
                self._receive(conn, layers, dest, hdr.count * self.cache.layout.block_bytes)
        finally:
            inc.leave(conn)
        if not pulled:  # the tags authenticated every byte
            self._land(inc, hdr, layers)
        elif sum(len(v) for v in views) <= INLINE_VERIFY_BYTES:
            self._verify(conn, seq, inc, hdr, layers, views)
        else:
            conn.verify.put((conn, seq, inc, hdr, layers, views))

    def _views(self, layers: range, dest: list[int], runs: list[tuple[int, int, int]]) -> list[memoryview]:
        """The landed bytes of ``dest``, one view per (layer, plane, run: (any, first block, count))."""
        if isinstance(self.mem, DeviceKV):  # host copies of what the pull wrote into device memory
            return self.mem.read(layers, dest).views([n * self.mem.block_bytes for _ in layers
                                                      for _ in self.mem.kinds for _, _, n in runs])
        return [self.mem.run(layer, kind, d, n) for layer in layers for kind in self.mem.kinds for _, d, n in runs]

    def _receive(self, conn: _Conn, layers: range, dest: list[int], record_bytes: int) -> None:
        """A frame's payload into blocks ``dest`` of ``layers``: straight into host memory, or through a
        pinned buffer into device memory."""
        if isinstance(self.mem, DeviceKV):
            landing = self.mem.landing(layers, dest)
            conn.live.reader.recv_payload(landing.views(), record_bytes)
            self.mem.land(landing)
            return
        views = [self.mem.run(layer, kind, first_id, n) for layer in layers for kind in self.mem.kinds
                 for _, first_id, n in coalesce(dest)]
        conn.live.reader.recv_payload(views, record_bytes)

    def _receive_coded(self, conn: _Conn, layers: range, dest: list[int], payload: int) -> None:
        """A coded frame's payload (size checked by _frame_shape) opened into a buffer, then decoded
        into blocks ``dest`` of ``layers`` in the cache's dtype (on its device)."""
        kinds, kv = self.cache.layout.kinds, self.cache.kv
        raw = torch.empty(payload, dtype=torch.uint8, pin_memory=kv.is_cuda)
        conn.live.reader.recv_payload([memoryview(raw.numpy())], 0)  # type: ignore[arg-type]  # numpy's stubs
        index = torch.tensor(dest, device=kv.device)
        # decoded where the cache is: on a GPU the coded bytes cross to the device, not the decoded ones
        planes = decode_planes(conn.live.codec, self.cache.layout, raw.to(kv.device), len(dest), len(layers) * kinds)
        for i, plane in enumerate(planes):
            kv[layers.start + i // kinds, i % kinds].index_copy_(0, index, plane)
        if kv.is_cuda:
            torch.cuda.current_stream(kv.device).synchronize()  # landed before it counts as landed

    def _verify_loop(self, conn: _Conn) -> None:
        """Checks pulled frames off the receiving thread, so the next frame is
        pulled while this one is checked."""
        for item in iter(conn.verify.get, None):
            self._verify(*item)

    def _verify(self, conn: _Conn, seq: int, inc: _Incoming, hdr: pb.KVBlocks, layers: range,
                views: list[memoryview]) -> None:
        """Pulled blocks against the tags the (authenticated) header carries."""
        bad = conn.live.reader.bad_pulled(seq, views, hdr.pulled_tags)
        if bad:
            runs = paired_runs(list(hdr.src_blocks), inc.block_ids[hdr.first:hdr.first + hdr.count])
            bad_blocks = sorted({runs[i % len(runs)][1] + k for i in bad for k in range(runs[i % len(runs)][2])})
            inc.handle.fail(f"pulled KV failed authentication in layers {layers.start}-{layers.stop - 1} of "
                            f"{len(bad_blocks)} block(s) (altered, or not what the sender tagged)", bad_blocks)
            self._maybe_complete(hdr.transfer_id, inc)
        else:
            self._land(inc, hdr, layers)

    def _land(self, inc: _Incoming, hdr: pb.KVBlocks, layers: range) -> None:
        n, ones, kinds = len(inc.block_ids), b"\x01" * hdr.count, self.cache.layout.kinds
        with inc.cond:
            for layer in layers:
                for kind in range(kinds):
                    at = (layer * kinds + kind) * n + hdr.first
                    inc.missing -= hdr.count - inc.landed.count(1, at, at + hdr.count)  # a block sent twice counts once
                    inc.landed[at:at + hdr.count] = ones
            nbytes = len(layers) * kinds * hdr.count * self.cache.layout.block_bytes
            inc.nbytes += nbytes
        self.bytes_received += nbytes
        self._maybe_complete(hdr.transfer_id, inc)

    def _refuse_sender(self, conn: _Conn, tid: str, inc: _Incoming) -> None:
        """A sender wrote to a reservation that names another: counted and logged, the reservation untouched."""
        self.wrong_sender += 1
        peer = conn.session.peer if conn.session is not None else None
        log.warning("refused KV for transfer %s from %s: the reservation is for kvrelay://%s", tid[:80], peer,
                    inc.sender)

    def _on_done(self, conn: _Conn, done: pb.KVDone) -> None:
        inc = self._expected.get(done.transfer_id)
        if inc is not None and not inc.takes_from(conn):
            self._refuse_sender(conn, done.transfer_id, inc)
            conn.send(pb.KVFrame(done_ack=pb.KVDoneAck(transfer_id=done.transfer_id, ok=False,
                                                       reason="the reservation is for another sender")))
            return
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
            if state is not TransferState.FAILED and inc.missing:
                return
            inc.acked = True
        if state is not TransferState.FAILED:
            inc.handle.complete(TransferResult(inc.done.first_token_id, inc.done.first_logprob, inc.nbytes,
                                               time.perf_counter() - inc.started, inc.done.traceparent[:64]))
            with self._lock:  # done: later frames for it are dropped unread
                if self._expected.get(tid) is inc:
                    del self._expected[tid]
            inc.forget(tid)
        err = inc.handle.failure()
        if inc.done_conn is None:  # set with done (_on_done)
            raise RuntimeError(f"transfer {tid}: its done came on no connection")
        inc.done_conn.send(pb.KVFrame(done_ack=pb.KVDoneAck(transfer_id=tid, ok=err is None,
                                                            reason=err.reason if err else "")))
