"""A sender's channel to one receiver endpoint, shared by every transport:
``streams`` authenticated connections (kvtransfer/handshake.py), each with a
writer thread that merges queued layers into frames and sends them as records
(kvtransfer/record.py: the sealed header, then the payload sealed straight
from the KV tensor, or block ids and a MAC of each run when the receiver
pulls) and an ack thread."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import (
    KVCodec,
    MemoryOffer,
    SendHandle,
    TransferHandle,
    TransferResult,
    TransferState,
    TransferTarget,
)
from kvrelay.kvtransfer.coded import coded_bytes, encode_planes
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.handles import StateHandle
from kvrelay.kvtransfer.handshake import SenderHello, Session, client_handshake
from kvrelay.kvtransfer.memory import coalesce, paired_runs
from kvrelay.kvtransfer.staging import DeviceKV, Staged, kv_memory
from kvrelay.kvtransfer.wire import (
    ProtocolError,
    acked_bytes,
    min_rtt_s,
    network_busy_us,
    retransmitting,
    tune_socket,
    written_mark,
)
from kvrelay.v1 import kv_wire_pb2 as pb

log = logging.getLogger(__name__)

STICKY_BYTES = 4 << 20
"""A transfer keeps using the stream that carried its previous layer while
that stream has less than this queued (so small transfers merge into few
frames); beyond it, the next layer goes to the least-loaded stream."""


MERGE_BYTES = 8 << 20
"""Largest frame queued layers are merged into."""
READER_GRACE_S = 1.0
"""How long a failed write waits for the ack thread to read the receiver's reason."""
LINK_BOUND_SHARE = 0.9
"""A transfer is link-bound (its rate is the link's, not a lower bound: kvtransfer/base.py TransferResult)
when the connections that carried it were held back by the network (wire.network_busy_us), together, for
this share of its time on the wire (a sender with a backlog keeps its connection busy throughout; one that
waits for each layer keeps it busy for the layer's bytes plus a round trip: measured 89% for int8-coded KV
made at 35 Mbit/s on a 50 Mbit/s link, whose rate it would understate)..."""
LINK_BOUND_MIN_S = 0.1
"""... and that time is at least this long (the kernel counts in 1-4 ms ticks)."""


@dataclass(slots=True)
class LayerRun:
    """Layers ``[layer, layer + num_layers)`` of one transfer's blocks ``src``,
    for the target's blocks from index ``first`` on (queued with one layer;
    consecutive layers of the same blocks merge into one frame)."""

    handle: ChannelSendHandle
    layer: int
    src: list[int]
    first: int
    num_layers: int = 1
    staged: list[Staged] = field(default_factory=list)
    """A cache in CUDA memory: each layer's blocks on their way to a pinned buffer (kvtransfer/staging.py)."""

    def views(self, mem, runs: list[tuple[int, int, int]]) -> list[memoryview]:
        """The run's bytes, one view per (layer, plane, run of ``runs``: (source block, any, count))."""
        if not self.staged:
            return [mem.run(lyr, kind, b, n) for lyr in range(self.layer, self.layer + self.num_layers)
                    for kind in mem.kinds for b, _, n in runs]
        if self.staged[0].coded:  # each layer's planes, encoded on the device: the frame's payload as it is
            return [v for st in self.staged for v in st.views([st.buf.numel()])]
        sizes = [n * mem.block_bytes for _ in mem.kinds for _, _, n in runs]
        return [v for st in self.staged for v in st.views(sizes)]

    def nbytes(self, block_bytes: int) -> int:
        """Bytes of K and V the run carries (``block_bytes``: of every plane of a layer's block)."""
        return self.num_layers * len(self.src) * block_bytes

    def merges_with(self, later: LayerRun, block_bytes: int) -> bool:
        """``later`` is the next layer of the same blocks of the same transfer,
        and the merged frame fits MERGE_BYTES."""
        return (later.handle is self.handle and later.src == self.src and later.first == self.first
                and later.layer == self.layer + self.num_layers and later.num_layers == 1
                and (self.num_layers + 1) * len(self.src) * block_bytes <= MERGE_BYTES)


@dataclass(slots=True)
class TransferDone:
    """The end of one transfer: the first sampled token travels with it."""

    handle: ChannelSendHandle
    token: int
    logprob: float


SendItem = LayerRun | TransferDone
"""What a stream's queue holds (None in the queue: the stream closes)."""


class SendStream:
    """One authenticated connection to a peer. A writer thread merges queued
    layers into frames and seals them; a reader thread takes acknowledgements."""

    def __init__(self, pool: PeerChannel, index: int) -> None:
        self.pool = pool
        self.index = index
        self.q: queue.SimpleQueue[SendItem | None] = queue.SimpleQueue()
        self.queued = 0
        """Bytes queued on this stream and not sent yet."""
        self._qlock = threading.Lock()
        self.sock: socket.socket | None = None
        self.session: Session | None = None
        """The authenticated connection's records each way."""
        self.shared = False
        """The receiver pulls from our memory (shared memory, NIXL): frames carry block ids only."""
        self.inflight: set[str] = set()
        self._marks: dict[str, int] = {}
        """Transfer id -> where its first frame on this connection began (wire.written_mark)."""
        self._written: dict[str, list[SendItem]] = {}
        """Transfer id -> its items written on this connection, kept until it is acknowledged:
        what is resent on a fresh connection when this one dies before the receiver got any of them."""
        self._blk = threading.Lock()
        self._sending: ChannelSendHandle | None = None
        """The transfer whose frame the writer is sending now (see :meth:`retire_if_stuck`)."""
        self._slock = threading.Lock()
        self._reader: threading.Thread | None = None
        threading.Thread(target=self._write_loop, name=f"kv-send-{index}", daemon=True).start()

    def put(self, item: SendItem | None, nbytes: int = 0) -> None:
        with self._qlock:
            self.queued += nbytes
        self.q.put(item)

    def _sent(self, nbytes: int) -> None:
        with self._qlock:
            self.queued -= nbytes

    def _connect(self) -> None:
        cfg = self.pool.cfg
        host, _, port = self.pool.endpoint.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=cfg.connect_timeout_s)
        tune_socket(sock, cfg.socket_buffer_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(cfg.stall_timeout_s * 1e3)))
        try:
            session = client_handshake(sock, self.pool.hello, self.pool.offer())
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        self.session, self.shared, self.sock = session, session.shared, sock
        self._reader = threading.Thread(target=self._read_loop, args=(sock, session), name=f"kv-ack-{self.index}",
                                        daemon=True)
        self._reader.start()

    def _lost(self, reason: str) -> None:
        """A write failed: the receiver may have said why before it closed
        (a refused record), so the ack thread gets a moment to read that first."""
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(READER_GRACE_S)
        self._broken(reason, resend=True)

    def _broken(self, reason: str, resend: bool = False) -> None:
        """Fails the transfers on this connection with ``reason``, then closes
        it (in this order: the other thread's error on the closed socket
        must not be the reason they see). With ``resend`` (the connection was
        lost, not refused), a transfer of which the receiver's TCP
        acknowledged no byte on this connection (a pooled connection that died
        while idle, or on a link that was cut) is queued again once, for a
        fresh connection: the receiver never saw any of it there."""
        with self._blk:
            sock, self.sock = self.sock, None
            acked = acked_bytes(sock) if sock is not None and resend else None
            again = []
            for tid in list(self.inflight):
                h = self.pool.handles.get(tid)
                if h is None:
                    continue
                mark = self._marks.get(tid)
                if acked is not None and mark is not None and acked <= mark and h.resend_once():
                    again.append((h, self._written.get(tid, [])))
                else:
                    h.fail(reason)
            self.inflight.clear()
            self._marks.clear()
            self._written.clear()
        for h, items in again:
            log.warning("KV connection to %s lost before the receiver got any of transfer %s (%s): "
                        "resending it on a fresh connection", self.pool.endpoint, h.transfer_id, reason)
            for item in items:
                self.put(item, item.nbytes(self.pool.mem.layer_block_bytes) if isinstance(item, LayerRun) else 0)
        if sock is not None:
            try:  # shutdown first: it wakes the reader blocked on this socket and sends the FIN, which
                sock.shutdown(socket.SHUT_RDWR)  # close alone does not while that read holds the socket
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass

    def _batches(self) -> Iterator[SendItem | None]:
        """Yields queued items, merging the runs of one transfer for the same
        blocks and consecutive layers into one multi-layer run of at most
        MERGE_BYTES (so a receiver that pulls overlaps pulling one frame with
        checking the last)."""
        block_bytes = self.pool.mem.layer_block_bytes
        while True:
            items = [self.q.get()]
            while True:
                try:
                    items.append(self.q.get_nowait())
                except queue.Empty:
                    break
            merged: list[SendItem | None] = []
            for it in items:
                prev = merged[-1] if merged else None
                if isinstance(it, LayerRun) and isinstance(prev, LayerRun) and prev.merges_with(it, block_bytes):
                    prev.num_layers += 1
                    prev.staged.extend(it.staged)
                else:
                    merged.append(it)
            yield from merged

    def _prepare(self, item: SendItem) -> tuple[int, list[memoryview] | None] | None:
        """An item's byte count and views into the KV tensor; None (counted
        as sent) when its transfer already failed."""
        mem = self.pool.mem
        nbytes = item.nbytes(mem.layer_block_bytes) if isinstance(item, LayerRun) else 0
        if not item.handle.enter():
            self._sent(nbytes)
            return None
        views = None
        if isinstance(item, LayerRun):
            views = item.views(mem, [(b, b, n) for _, b, n in coalesce(item.src)])
        return nbytes, views

    def _write_loop(self) -> None:
        """Merges what is queued into frames and sends them (one thread: a
        hand-off to another costs more than merging)."""
        for queued in self._batches():
            if queued is None:
                break
            prepared = self._prepare(queued)
            if prepared is None:
                continue
            nbytes, views = prepared
            h = queued.handle
            try:
                if h.poll() is TransferState.FAILED:
                    continue
                self.inflight.add(h.transfer_id)
                if self.sock is None:
                    self._connect()
                self._send(queued, views, nbytes)
            except ProtocolError as exc:
                self._broken(f"handshake with {self.pool.endpoint} failed: {exc}")
            except OSError as exc:
                self._lost(f"connection to {self.pool.endpoint} failed: {exc}")
            except Exception as exc:  # a bug: fail these transfers now rather than leave them to their leases
                log.exception("KV send thread for %s failed", self.pool.endpoint)
                self._broken(f"sender error: {exc!r}")
            finally:
                h.leave()
                self._sent(nbytes)
        self._broken("sender closed")

    def _send(self, item: SendItem, views: list[memoryview] | None, nbytes: int) -> None:
        """One frame of ``item`` on the connection, marked as being sent meanwhile."""
        with self._slock:
            self._sending = item.handle
        tid = item.handle.transfer_id
        if tid not in self._marks and self.sock is not None:
            mark = written_mark(self.sock)
            if mark is not None:
                self._marks[tid] = mark
        self._written.setdefault(tid, []).append(item)
        if item.handle.drop_connections > 0 and self.sock is not None:
            item.handle.drop_connections -= 1  # fault injection: the connection dies before this frame leaves
            self.sock.shutdown(socket.SHUT_RDWR)
        try:
            if isinstance(item, LayerRun):
                item.handle.writing(self.index, None if self.shared else self.sock)
                self._send_blocks(item, views or [], nbytes)
            else:
                self._live().writer.send(pb.KVFrame(done=pb.KVDone(
                    transfer_id=item.handle.transfer_id, first_token_id=item.token, first_logprob=item.logprob,
                    traceparent=item.handle.target.traceparent[:64])))
        finally:
            with self._slock:
                self._sending = None

    def _live(self) -> Session:
        """The connection's session (the writer connects before it sends)."""
        if self.session is None:
            raise ConnectionError(f"no KV connection to {self.pool.endpoint}")
        return self.session

    @property
    def sending(self) -> str | None:
        """The transfer whose frame the writer is sending now (None: idle or between frames)."""
        with self._slock:
            return self._sending.transfer_id if self._sending is not None else None

    def retire_if_stuck(self, h: TransferHandle) -> bool:
        """Closes the connection that carried ``h``, which failed with frames on
        it, when that connection is stuck: its writer is in the middle of a
        frame of ``h`` (the rest of it is of no use), or the kernel is resending
        its data on the retransmission timer (a link that was cut: once the link
        is back, such a connection stays in its backoff for seconds). Either way
        it would hold up every transfer queued behind it. The writer's send
        fails at once, the transfers in flight on the connection fail as on any
        lost connection (the caller's policy retries them), and the next item
        connects afresh. A healthy connection is kept. Whether it closed one."""
        with self._slock:  # not when the receiver refused h: its ack took h out of inflight first
            sock = self.sock if h.transfer_id in self.inflight else None
            mid_frame = self._sending is h
        if sock is None or not (mid_frame or retransmitting(sock)):
            return False
        log.warning("KV connection to %s retired: transfer %s failed %s", self.pool.endpoint, h.transfer_id,
                    "while its frame was being sent" if mid_frame else "and the connection is retransmitting")
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed meanwhile
        return True

    def _send_blocks(self, run: LayerRun, views: list[memoryview], nbytes: int) -> None:
        h, layer, src, first, num_layers = run.handle, run.layer, run.src, run.first, run.num_layers
        tamper, h.corrupt = h.corrupt, False  # fault injection: what arrives must be refused
        # counted before the frame leaves: the receiver may acknowledge the whole transfer (on
        # another stream's reader thread) before this thread runs again after the send
        codec = self.pool.hello.codec  # what crosses the wire: the coded bytes under a codec
        h.add_bytes(nbytes if codec is KVCodec.NONE
                    else coded_bytes(codec, self.pool.cache.layout, len(src), num_layers))
        if self.shared:  # the receiver pulls: block ids and a MAC of each run it pulls
            dest = list(h.target.block_ids[first:first + len(src)])
            runs = run.views(self.pool.mem, paired_runs(src, dest))
            tags = bytearray(self._live().writer.tag_pulled(runs))
            if tamper:
                tags[0] ^= 1
            frame = pb.KVBlocks(transfer_id=h.transfer_id, layer=layer, num_layers=num_layers, first=first,
                                count=len(src), src_blocks=src, pulled_tags=bytes(tags))
            self._live().writer.send(pb.KVFrame(blocks=frame))
        elif codec is not KVCodec.NONE:
            self._send_coded(run, views, tamper)
        else:
            frame = pb.KVBlocks(transfer_id=h.transfer_id, layer=layer, num_layers=num_layers, first=first,
                                count=len(src), payload_bytes=nbytes)
            self._live().writer.send(pb.KVFrame(blocks=frame), views, tamper, len(src) * self.pool.mem.block_bytes)

    def _send_coded(self, run: LayerRun, views: list[memoryview], tamper: bool) -> None:
        """The frame of ``run`` under the channel's codec: its planes encoded (scales first, so a flipped
        first byte, ``tamper``, lands in a scale), sealed as any payload."""
        codec, layout = self.pool.hello.codec, self.pool.cache.layout
        if run.staged:  # encoded on the device already (DeviceKV.stage_coded)
            payload = views
        else:
            per_plane = len(views) // (run.num_layers * layout.kinds)
            planes = [views[i:i + per_plane] for i in range(0, len(views), per_plane)]
            payload = encode_planes(codec, layout, planes, len(run.src))
        frame = pb.KVBlocks(transfer_id=run.handle.transfer_id, layer=run.layer, num_layers=run.num_layers,
                            first=run.first, count=len(run.src), payload_bytes=sum(len(v) for v in payload),
                            codec=self._header_codec())
        self._live().writer.send(pb.KVFrame(blocks=frame), payload, tamper)

    def _header_codec(self) -> str:
        """The codec a blocks frame names: the connection's (a test makes it lie)."""
        return self.pool.hello.codec.value

    def acknowledged(self, tid: str) -> None:
        """The receiver answered transfer ``tid``: this connection forgets it."""
        with self._blk:
            self.inflight.discard(tid)
            self._marks.pop(tid, None)
            self._written.pop(tid, None)

    def _read_loop(self, sock: socket.socket, session: Session) -> None:
        try:
            while True:
                frame, payload = session.reader.recv()
                if frame.WhichOneof("body") != "done_ack" or payload:
                    raise ProtocolError("unexpected frame from receiver")
                ack = frame.done_ack
                if not ack.transfer_id:  # the receiver refused the whole stream
                    raise ProtocolError(f"receiver refused the connection: {ack.reason}")
                h = self.pool.handles.pop(ack.transfer_id, None)
                for s in self.pool.streams:
                    s.acknowledged(ack.transfer_id)
                if h is None:
                    continue
                if ack.ok:
                    h.complete(h.timed(min_rtt_s(sock)))
                else:
                    h.fail(f"receiver rejected the transfer: {ack.reason}")
        except (OSError, ConnectionError, ProtocolError) as exc:
            if self.sock is sock:
                self._broken(f"connection to {self.pool.endpoint} lost ({exc})",
                             resend=not isinstance(exc, ProtocolError))


class PeerChannel:
    """The streams to one receiver endpoint for one link setting, and the
    transfers open on them."""

    def __init__(self, endpoint: str, cache: KVCache, cfg: TransferConfig, memory: MemoryOffer | None = None,
                 receiver: str | None = None) -> None:
        """``receiver``: the identity the receiver's certificate must name (None: any we accept)."""
        self.endpoint = endpoint
        self.cache = cache
        self.mem = kv_memory(cache)
        self.cfg = cfg
        self.memory = memory
        """What lets receivers pull from us (NIXL, shared memory); None = bytes only."""
        self.layout_hash = cache.layout.compat_hash()
        self.hello = SenderHello(cfg.secret, self.layout_hash, cfg.credentials, cfg.protection, receiver,
                                 cfg.socket_buffer_bytes, cfg.codec)
        """What every connection of this channel asks in its handshake."""
        self.handles: dict[str, ChannelSendHandle] = {}
        self.streams = [SendStream(self, i) for i in range(cfg.streams)]

    def offer(self) -> pb.KVOffer | None:
        """What lets the receiver pull from us instead of reading bytes (sent sealed, after authentication)."""
        if not self.cfg.offer_memory or self.memory is None:
            return None
        return self.memory.offer()

    def pick(self, previous: SendStream | None) -> SendStream:
        """The stream for a transfer's next layer (see STICKY_BYTES)."""
        if previous is not None and previous.queued < STICKY_BYTES:
            return previous
        return min(self.streams, key=lambda s: s.queued)

    def ended(self, h: TransferHandle) -> None:
        """``h`` is DONE or FAILED: forgotten here; if it failed on a stuck connection, that one is retired."""
        self.handles.pop(h.transfer_id, None)
        if h.poll() is TransferState.FAILED:
            for s in self.streams:
                s.retire_if_stuck(h)

    def close(self) -> None:
        for s in self.streams:
            s.put(None)


class ChannelSendHandle(StateHandle, SendHandle):
    """One transfer's layers, queued on the streams of its channel."""

    def __init__(self, pool: PeerChannel, target: TransferTarget) -> None:
        super().__init__(target.transfer_id)
        self.pool = pool
        self.target = target
        self.nbytes = 0
        self.started = time.perf_counter()
        self.first_token = 0
        self.first_logprob = 0.0
        self._busy = threading.Condition()
        self._readers = 0
        self._stream: SendStream | None = None
        self.corrupt = False
        """Fault injection: flip a byte of this transfer's first frame."""
        self.drop_connections = 0
        """Fault injection: this many connections die just before they carry a frame of this transfer."""
        self._resent = False
        self._first_write = 0.0
        """When its first frame began to be written (perf_counter; 0: not yet, or the receiver pulls)."""
        self._busy_at: dict[int, int] = {}
        """Stream index -> its connection's network-busy microseconds when this transfer first wrote there."""
        self.advance(TransferState.WAITING)

    def writing(self, stream: int, sock: socket.socket | None) -> None:
        """Stream ``stream`` starts writing one of its frames on ``sock`` (None: a frame the receiver pulls,
        which is not timed); its connection's network-busy time is read once, at this transfer's first
        frame there."""
        if sock is None or stream in self._busy_at:
            return
        busy_us = network_busy_us(sock)
        if busy_us is None:
            return
        if not self._first_write:
            self._first_write = time.perf_counter()
        self._busy_at[stream] = busy_us

    def timed(self, rtt_s: float) -> TransferResult:
        """What it delivered, now acknowledged (``rtt_s``: the acknowledging connection's least RTT), timed
        on the wire: link-bound when the connections that carried it were held back by the network, together,
        for at least LINK_BOUND_SHARE of the time its bytes were crossing."""
        now = time.perf_counter()
        wire = now - self._first_write if self._first_write else 0.0
        crossing_us = (wire - rtt_s) * 1e6
        held_us = 0
        for index, since in list(self._busy_at.items()):
            sock = self.pool.streams[index].sock
            busy = network_busy_us(sock) if sock is not None else None
            held_us += max(0, busy - since) if busy is not None else 0  # a replaced connection counts from 0
        bound = crossing_us >= LINK_BOUND_MIN_S * 1e6 and held_us >= LINK_BOUND_SHARE * crossing_us
        busy_s = min(held_us, crossing_us) / 1e6 if bound else 0.0  # streams side by side: the wall time
        return TransferResult(self.first_token, self.first_logprob, self.nbytes, now - self.started, wire_s=wire,
                              link_bound=bound, rtt_s=rtt_s, busy_s=busy_s)

    def resend_once(self) -> bool:
        """Whether this transfer may be queued again after a lost connection (once; never after it failed)."""
        with self._busy:
            if self._resent or self.poll() is TransferState.FAILED:
                return False
            self._resent = True
            return True

    def add_bytes(self, n: int) -> None:
        with self._busy:
            self.nbytes += n

    def enter(self) -> bool:
        """A stream thread starts an item; False when the transfer already failed."""
        with self._busy:
            if self.poll() is TransferState.FAILED:
                return False
            self._readers += 1
            return True

    def leave(self) -> None:
        with self._busy:
            self._readers -= 1
            self._busy.notify_all()

    def quiesce(self, timeout_s: float) -> bool:
        with self._busy:
            return self._busy.wait_for(lambda: self._readers == 0, timeout_s)

    def send_layer(self, layer: int, src_blocks: list[int], first: int) -> None:
        if not src_blocks:
            return
        if first + len(src_blocks) > len(self.target.block_ids):
            self.fail(f"layer {layer}: blocks [{first}, {first + len(src_blocks)}) beyond the target's "
                      f"{len(self.target.block_ids)}")
            return
        self.advance(TransferState.TRANSFERRING)
        self._stream = self.pool.pick(self._stream)
        run = LayerRun(self, layer, list(src_blocks), first)
        mem, codec = self.pool.mem, self.pool.hello.codec
        if isinstance(mem, DeviceKV):  # copied out once the engine's writes to the layer are complete
            layers = range(layer, layer + 1)
            run.staged.append(mem.stage(layers, run.src) if codec is KVCodec.NONE
                              else mem.stage_coded(layers, run.src, codec))
        self._stream.put(run, run.nbytes(self.pool.mem.layer_block_bytes))

    def finish(self, first_token_id: int, first_logprob: float) -> None:
        self.first_token, self.first_logprob = first_token_id, first_logprob
        (self._stream or self.pool.streams[0]).put(TransferDone(self, first_token_id, first_logprob))
