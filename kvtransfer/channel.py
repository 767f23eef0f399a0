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
from typing import TYPE_CHECKING

from kvrelay.v1 import kv_wire_pb2 as pb

from engine.kv_cache import KVCache
from kvtransfer.base import MemoryOffer, TransferResult, TransferState
from kvtransfer.config import TransferConfig
from kvtransfer.handshake import SenderHello, Session, client_handshake
from kvtransfer.memory import KVBytes, coalesce, paired_runs
from kvtransfer.wire import ProtocolError, tune_socket

if TYPE_CHECKING:
    from kvtransfer.sender import ChannelSendHandle

log = logging.getLogger(__name__)

STICKY_BYTES = 4 << 20
"""A transfer keeps using the stream that carried its previous layer while
that stream has less than this queued (so small transfers merge into few
frames); beyond it, the next layer goes to the least-loaded stream."""


MERGE_BYTES = 8 << 20
"""Largest frame queued layers are merged into."""
READER_GRACE_S = 1.0
"""How long a failed write waits for the ack thread to read the receiver's reason."""


class SendStream:
    """One authenticated connection to a peer. A writer thread merges queued
    layers into frames and seals them; a reader thread takes acknowledgements."""

    def __init__(self, pool: PeerChannel, index: int) -> None:
        self.pool = pool
        self.index = index
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0
        """Bytes queued on this stream and not sent yet."""
        self._qlock = threading.Lock()
        self.sock: socket.socket | None = None
        self.session: Session | None = None
        """The authenticated connection's records each way."""
        self.shared = False
        """The receiver pulls from our memory (shared memory, NIXL): frames carry block ids only."""
        self.inflight: set[str] = set()
        self._reader: threading.Thread | None = None
        threading.Thread(target=self._write_loop, name=f"kv-send-{index}", daemon=True).start()

    def put(self, item: tuple | None, nbytes: int = 0) -> None:
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
        self._broken(reason)

    def _broken(self, reason: str) -> None:
        """Fails the transfers on this connection with ``reason``, then closes
        it (in this order: the other thread's error on the closed socket
        must not be the reason they see)."""
        sock, self.sock = self.sock, None
        for tid in list(self.inflight):
            h = self.pool.handles.get(tid)
            if h is not None:
                h.fail(reason)
        self.inflight.clear()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _batches(self):
        """Yields queued items, merging runs of "blocks" items of one transfer
        for the same blocks and consecutive layers into one multi-layer item
        of at most MERGE_BYTES (so a receiver that pulls overlaps pulling
        one frame with checking the last)."""
        layer_bytes = 2 * self.pool.mem.block_bytes
        while True:
            items = [self.q.get()]
            while True:
                try:
                    items.append(self.q.get_nowait())
                except queue.Empty:
                    break
            merged: list = []
            for it in items:
                prev = merged[-1] if merged else None
                if (it is not None and prev is not None and it[0] == prev[0] == "blocks" and it[1] is prev[1]
                        and it[3] == prev[3] and it[4] == prev[4] and it[2] == prev[2] + prev[5]
                        and (prev[5] + 1) * len(it[3]) * layer_bytes <= MERGE_BYTES):
                    merged[-1] = (*prev[:5], prev[5] + 1)
                else:
                    merged.append(it if it is None or it[0] != "blocks" else (*it, 1))
            yield from merged

    def _prepare(self, item: tuple) -> tuple | None:
        """A merged item with its byte count and views into the KV tensor;
        None (counted as sent) when its transfer already failed."""
        mem = self.pool.mem
        h = item[1]
        nbytes = item[5] * 2 * len(item[3]) * mem.block_bytes if item[0] == "blocks" else 0
        if not h.enter():
            self._sent(nbytes)
            return None
        views = None
        if item[0] == "blocks":
            _, _, layer, src, _, num_layers = item
            runs = coalesce(src)
            views = [mem.run(lyr, kind, b, n) for lyr in range(layer, layer + num_layers)
                     for kind in (0, 1) for _, b, n in runs]
        return item, nbytes, views

    def _write_loop(self) -> None:
        """Merges what is queued into frames and sends them (one thread: a
        hand-off to another costs more than merging)."""
        for queued in self._batches():
            if queued is None:
                break
            prepared = self._prepare(queued)
            if prepared is None:
                continue
            item, nbytes, views = prepared
            h = item[1]
            try:
                if h.poll() is TransferState.FAILED:
                    continue
                self.inflight.add(h.transfer_id)
                if self.sock is None:
                    self._connect()
                if item[0] == "blocks":
                    self._send_blocks(h, item, views, nbytes)
                else:
                    _, _, token, logprob = item
                    self.session.writer.send(pb.KVFrame(done=pb.KVDone(
                        transfer_id=h.transfer_id, first_token_id=token, first_logprob=logprob,
                        traceparent=h.target.traceparent[:64])))
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

    def _send_blocks(self, h: ChannelSendHandle, item: tuple, views: list[memoryview], nbytes: int) -> None:
        _, _, layer, src, first, num_layers = item
        tamper, h.corrupt = h.corrupt, False  # fault injection: what arrives must be refused
        # counted before the frame leaves: the receiver may acknowledge the whole transfer (on
        # another stream's reader thread) before this thread runs again after the send
        h.add_bytes(nbytes)
        if self.shared:  # the receiver pulls: block ids and a MAC of each run it pulls
            dest = list(h.target.block_ids[first:first + len(src)])
            mem = self.pool.mem
            runs = [mem.run(lyr, kind, s, n) for lyr in range(layer, layer + num_layers) for kind in (0, 1)
                    for s, _, n in paired_runs(src, dest)]
            tags = bytearray(self.session.writer.tag_pulled(runs))
            if tamper:
                tags[0] ^= 1
            frame = pb.KVBlocks(transfer_id=h.transfer_id, layer=layer, num_layers=num_layers, first=first,
                                count=len(src), src_blocks=src, pulled_tags=bytes(tags))
            self.session.writer.send(pb.KVFrame(blocks=frame))
        else:
            frame = pb.KVBlocks(transfer_id=h.transfer_id, layer=layer, num_layers=num_layers, first=first,
                                count=len(src), payload_bytes=nbytes)
            self.session.writer.send(pb.KVFrame(blocks=frame), views, tamper, len(src) * self.pool.mem.block_bytes)

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
                    s.inflight.discard(ack.transfer_id)
                if h is None:
                    continue
                if ack.ok:
                    h.complete(TransferResult(h.first_token, h.first_logprob, h.nbytes,
                                              time.perf_counter() - h.started))
                else:
                    h.fail(f"receiver rejected the transfer: {ack.reason}")
        except (OSError, ConnectionError, ProtocolError) as exc:
            if self.sock is sock:
                self._broken(f"connection to {self.pool.endpoint} lost ({exc})")


class PeerChannel:
    """The streams to one receiver endpoint for one link setting, and the
    transfers open on them."""

    def __init__(self, endpoint: str, cache: KVCache, cfg: TransferConfig, memory: MemoryOffer | None = None,
                 receiver: str | None = None) -> None:
        """``receiver``: the identity the receiver's certificate must name (None: any we accept)."""
        self.endpoint = endpoint
        self.cache = cache
        self.mem = KVBytes(cache)
        self.cfg = cfg
        self.memory = memory
        """What lets receivers pull from us (NIXL, shared memory); None = bytes only."""
        self.layout_hash = cache.layout.compat_hash()
        self.hello = SenderHello(cfg.secret, self.layout_hash, cfg.credentials, cfg.protection, receiver,
                                 cfg.socket_buffer_bytes)
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

    def close(self) -> None:
        for s in self.streams:
            s.put(None)
