"""The sender every transport builds on: ``ChannelSender`` opens transfers on
channels (kvtransfer/channel.py, where ``ChannelSendHandle`` queues a
transfer's layers on the channel's streams) pooled per receiver and per link setting.
A transport decides only what memory it offers receivers to pull from."""

from __future__ import annotations

import dataclasses
import logging
import threading

from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import (
    KVCodec,
    KVSender,
    MemoryOffer,
    SendHandle,
    TransferTarget,
)
from kvrelay.kvtransfer.channel import ChannelSendHandle, PeerChannel
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.protection import Protection

log = logging.getLogger(__name__)


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
        if target.socket_buffer_bytes is not None or target.protection is not None or target.pull is False \
                or target.codec is not None:
            codec = KVCodec.parse(target.codec) if target.codec is not None else cfg.codec
            cfg = dataclasses.replace(
                cfg, socket_buffer_bytes=target.socket_buffer_bytes or cfg.socket_buffer_bytes,
                protection=Protection.parse(target.protection or cfg.protection), codec=codec,
                offer_memory=cfg.offer_memory and target.pull is not False and codec is KVCodec.NONE)
        elif cfg.codec is not KVCodec.NONE and cfg.offer_memory:
            cfg = dataclasses.replace(cfg, offer_memory=False)  # a coded connection carries bytes
        return cfg

    def open(self, target: TransferTarget) -> SendHandle:
        """Starts a transfer. Connections are pooled per receiver (and the
        identity it must prove) and per link setting (socket buffers,
        protection, pulling, codec)."""
        try:
            cfg, refused = self._link_config(target), ""
        except ValueError as exc:
            cfg, refused = self.cfg, f"bad link setting: {exc}"
        key = (target.endpoint, target.receiver, cfg.socket_buffer_bytes, cfg.protection, cfg.offer_memory, cfg.codec)
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
        h.add_done_callback(pool.ended)
        return h

    def channels_to(self, endpoint: str) -> list[PeerChannel]:
        """The channels open to the receiver at ``endpoint`` (one per link setting)."""
        with self._lock:
            return [pool for key, pool in self._pools.items() if key[0] == endpoint]

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
