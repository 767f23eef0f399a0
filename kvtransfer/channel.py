"""A sender's channel to one receiver endpoint, shared by every transport:
``streams`` authenticated connections (the control connection and handshake
of kvtransfer/wire.py), each with a prepare thread that merges queued layers
into frames and checksums them, a writer thread (frame header, then the
payload with vectored writes straight from the KV tensor, or block ids only
when the receiver pulls) and an ack thread."""

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
from kvtransfer.memory import KVBytes, block_crcs, coalesce
from kvtransfer.wire import (
    PayloadCipher,
    ProtocolError,
    client_handshake,
    recv_frame,
    send_frame,
    send_views,
    tune_socket,
)

if TYPE_CHECKING:
    from kvtransfer.sender import ChannelSendHandle

log = logging.getLogger(__name__)

STICKY_BYTES = 4 << 20
"""A transfer keeps using the stream that carried its previous layer while
that stream has less than this queued (so small transfers merge into few
frames); beyond it, the next layer goes to the least-loaded stream."""


class SendStream:
    """One authenticated connection to a peer. A prepare thread merges
    queued layers into frames and checksums them while the writer thread
    sends the previous frame; a reader thread takes acknowledgements."""

    def __init__(self, pool: PeerChannel, index: int) -> None:
        self.pool = pool
        self.index = index
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0
        """Bytes queued on this stream and not sent yet."""
        self._qlock = threading.Lock()
        self.sock: socket.socket | None = None
        self.shared = False
        """The receiver pulls from our memory (shared memory, NIXL): frames carry block ids only."""
        self.cipher: PayloadCipher | None = None
        """When this connection encrypts."""
        self.inflight: set[str] = set()
        threading.Thread(target=self._prepare_loop, name=f"kv-prep-{index}", daemon=True).start()
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
        self.shared, self.cipher = client_handshake(sock, cfg.secret, self.pool.layout_hash, self.pool.offer(),
                                                    cfg.encrypt, cfg.socket_buffer_bytes)
        sock.settimeout(None)
        self.sock = sock
        threading.Thread(target=self._read_loop, args=(sock,), name=f"kv-ack-{self.index}", daemon=True).start()

    def _broken(self, reason: str) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        for tid in list(self.inflight):
            h = self.pool.handles.get(tid)
            if h is not None:
                h.fail(reason)
        self.inflight.clear()

    def _batches(self):
        """Yields queued items, merging runs of "blocks" items of one transfer
        for the same blocks and consecutive layers into one multi-layer item."""
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
                        and it[3] == prev[3] and it[4] == prev[4] and it[2] == prev[2] + prev[5]):
                    merged[-1] = (*prev[:5], prev[5] + 1)
                else:
                    merged.append(it if it is None or it[0] != "blocks" else (*it, 1))
            yield from merged

    def _prepare_loop(self) -> None:
        mem = self.pool.mem
        bb = mem.block_bytes
        for item in self._batches():
            if item is None:
                self.ready.put(None)
                return
            h = item[1]
            nbytes = item[5] * 2 * len(item[3]) * bb if item[0] == "blocks" else 0
            if not h.enter():
                self._sent(nbytes)
                continue
            views = crcs = None
            if item[0] == "blocks":
                _, _, layer, src, _, num_layers = item
                runs = coalesce(src)
                views = [mem.run(lyr, kind, b, n) for lyr in range(layer, layer + num_layers)
                         for kind in (0, 1) for _, b, n in runs]
                if not self.pool.cfg.encrypt:
                    crcs = block_crcs(views, bb)
            self.ready.put((item, nbytes, views, crcs))

    def _write_loop(self) -> None:
        for prepared in iter(self.ready.get, None):
            item, nbytes, views, crcs = prepared
            h = item[1]
            try:
                if h.poll() is TransferState.FAILED:
                    continue
                self.inflight.add(h.transfer_id)
                if self.sock is None:
                    self._connect()
                if item[0] == "blocks":
                    self._send_blocks(h, item, views, crcs, nbytes)
                else:
                    _, _, token, logprob = item
                    send_frame(self.sock, pb.KVFrame(done=pb.KVDone(
                        transfer_id=h.transfer_id, first_token_id=token, first_logprob=logprob)))
            except ProtocolError as exc:
                self._broken(f"handshake with {self.pool.endpoint} failed: {exc}")
            except OSError as exc:
                self._broken(f"connection to {self.pool.endpoint} failed: {exc}")
            except Exception as exc:  # a bug: fail these transfers now rather than leave them to their leases
                log.exception("KV send thread for %s failed", self.pool.endpoint)
                self._broken(f"sender error: {exc!r}")
            finally:
                h.leave()
                self._sent(nbytes)
        self._broken("sender closed")

    def _send_blocks(self, h: ChannelSendHandle, item: tuple, views: list[memoryview], crcs: list[int] | None,
                     nbytes: int) -> None:
        _, _, layer, src, first, num_layers = item
        cipher = None if self.shared else self.cipher
        if cipher is not None:
            crcs, wire_bytes = [], PayloadCipher.sealed_bytes(nbytes)
        else:
            if crcs is None:  # encryption was configured, but the receiver pulls
                crcs = block_crcs(views, self.pool.mem.block_bytes)
            wire_bytes = 0 if self.shared else nbytes
            if h.corrupt:  # fault injection: what arrives no longer matches its checksums
                h.corrupt = False
                if self.shared:
                    crcs = [crcs[0] ^ 1, *crcs[1:]]
                else:
                    flipped = bytearray(views[0])
                    flipped[0] ^= 0xFF
                    views = [memoryview(flipped), *views[1:]]
        send_frame(self.sock, pb.KVFrame(blocks=pb.KVBlocks(
            transfer_id=h.transfer_id, layer=layer, num_layers=num_layers, first=first, count=len(src),
            payload_bytes=wire_bytes, crc32c=crcs, src_blocks=src if self.shared else [])))
        if cipher is not None:
            cipher.send_sealed(self.sock, views)
        elif not self.shared:
            send_views(self.sock, views)
        h.add_bytes(nbytes)

    def _read_loop(self, sock: socket.socket) -> None:
        try:
            while True:
                frame = recv_frame(sock)
                if frame.WhichOneof("body") != "done_ack":
                    raise ProtocolError("unexpected frame from receiver")
                ack = frame.done_ack
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

    def __init__(self, endpoint: str, cache: KVCache, cfg: TransferConfig, memory: MemoryOffer | None = None
                 ) -> None:
        self.endpoint = endpoint
        self.cache = cache
        self.mem = KVBytes(cache)
        self.cfg = cfg
        self.memory = memory
        """What lets receivers pull from us (NIXL, shared memory); None = bytes only."""
        self.layout_hash = cache.layout.compat_hash()
        self.handles: dict[str, ChannelSendHandle] = {}
        self.streams = [SendStream(self, i) for i in range(cfg.streams)]

    def offer(self) -> pb.KVHello | None:
        """What lets the receiver pull from us instead of reading bytes."""
        if not self.cfg.offer_memory or self.memory is None:
            return None
        return self.memory.hello_fields()

    def pick(self, previous: SendStream | None) -> SendStream:
        """The stream for a transfer's next layer (see STICKY_BYTES)."""
        if previous is not None and previous.queued < STICKY_BYTES:
            return previous
        return min(self.streams, key=lambda s: s.queued)

    def close(self) -> None:
        for s in self.streams:
            s.put(None)
