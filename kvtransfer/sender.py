"""The sender every transport builds on: ``ChannelSender`` opens transfers on
channels (kvtransfer/channel.py) pooled per receiver and per link setting;
``ChannelSendHandle`` queues a transfer's layers on the channel's streams.
A transport decides only what memory it offers receivers to pull from."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from engine.kv_cache import KVCache
from kvtransfer.base import (
    KVSender,
    MemoryOffer,
    SendHandle,
    TransferState,
    TransferTarget,
)
from kvtransfer.channel import PeerChannel, SendStream
from kvtransfer.config import TransferConfig
from kvtransfer.handles import StateHandle
from kvtransfer.protection import Protection

log = logging.getLogger(__name__)


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
        self.advance(TransferState.WAITING)

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
        self._stream.put(("blocks", self, layer, list(src_blocks), first),
                         2 * len(src_blocks) * self.pool.mem.block_bytes)

    def finish(self, first_token_id: int, first_logprob: float) -> None:
        self.first_token, self.first_logprob = first_token_id, first_logprob
        (self._stream or self.pool.streams[0]).put(("done", self, first_token_id, first_logprob))


class ChannelSender(KVSender):
    """Sends over authenticated channels to receivers; with a ``memory`` offer
    (and ``cfg.offer_memory``) receivers pull the blocks from that memory
    and frames carry block ids only."""

    def __init__(self, cache: KVCache, cfg: TransferConfig | None = None, memory: MemoryOffer | None = None
                 ) -> None:
        self.cache = cache
        self.cfg = cfg or TransferConfig()
        self.memory = memory
        self.cfg.check_authenticating()
        self._pools: dict[tuple, PeerChannel] = {}
        self._lock = threading.Lock()
        self._corrupt_left = self.cfg.corrupt_first

    def _link_config(self, target: TransferTarget) -> TransferConfig:
        """The config with the target's per-link settings applied."""
        cfg = self.cfg
        if target.socket_buffer_bytes is not None or target.protection is not None or target.pull is False:
            cfg = dataclasses.replace(
                cfg, socket_buffer_bytes=target.socket_buffer_bytes or cfg.socket_buffer_bytes,
                protection=Protection.parse(target.protection or cfg.protection),
                offer_memory=cfg.offer_memory and target.pull is not False)
        return cfg

    def open(self, target: TransferTarget) -> SendHandle:
        """Starts a transfer. Connections are pooled per receiver (and the
        identity it must prove) and per link setting (socket buffers,
        protection, pulling)."""
        try:
            cfg, refused = self._link_config(target), ""
        except ValueError as exc:
            cfg, refused = self.cfg, f"bad link setting: {exc}"
        key = (target.endpoint, target.receiver, cfg.socket_buffer_bytes, cfg.protection, cfg.offer_memory)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = PeerChannel(target.endpoint, self.cache, cfg, self.memory, target.receiver)
        h = ChannelSendHandle(pool, target)
        if refused:
            h.fail(refused)
            return h
        with self._lock:
            if self._corrupt_left > 0:
                self._corrupt_left -= 1
                h.corrupt = True
                log.warning("fault injection: corrupting transfer %s", target.transfer_id)
        if target.layout_hash != pool.layout_hash:
            h.fail("KV layout of the target differs from this sender's")
            return h
        pool.handles[target.transfer_id] = h
        h.add_done_callback(lambda done: pool.handles.pop(done.transfer_id, None))
        return h

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
