"""Local transport, for workers on the same host: the prefill worker's KV
cache lives in a shared-memory file (/dev/shm/kvrelay-*), and the decode
worker copies the blocks it is told about straight from it into its own
reserved blocks (one memcpy, no bytes on a socket). Control frames (the
authenticated handshake, block lists with a MAC of each run, done and its
acknowledgement) use the channel every transport shares
(kvtransfer/channel.py). Receivers map the file with ``SharedMemoryAttacher``
(the tcp and nixl receivers both do, so they serve local senders); a
receiver on another host simply gets the bytes over TCP."""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import Transport
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.sender import ChannelSender
from kvrelay.kvtransfer.wire import SHM_NAME, host_id
from kvrelay.v1 import kv_wire_pb2 as pb


def shm_path_for(worker_id: str, pid: int) -> str:
    """The shared-memory file name of a worker's KV cache."""
    safe = worker_id.replace("/", "-")
    return f"/dev/shm/kvrelay-{safe}-{pid}"


class SharedMemoryOffer:
    """MemoryOffer: a sender's KV cache in its shared-memory file, for receivers on this host."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def offer(self) -> pb.KVOffer:
        return pb.KVOffer(host_id=host_id(), shm_path=self.cache.shm_path, num_blocks=self.cache.num_blocks)


class SharedMemorySource:
    """MemorySource: a same-host sender's KV cache, mapped; pulling is one
    indexed copy per layer and K/V into the receiver's cache."""

    def __init__(self, peer: KVCache, cache: KVCache) -> None:
        self.peer = peer
        self.cache = cache

    @property
    def num_blocks(self) -> int:
        return self.peer.num_blocks

    def pull(self, layers: range, src: list[int], dest: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.long)
        device = self.cache.kv.device  # a receiver's cache may be in CUDA memory: the rows go there
        d = torch.tensor(dest, dtype=torch.long, device=device)
        for layer in layers:
            for kind in range(self.cache.layout.kinds):
                rows = self.peer.kv[layer, kind].index_select(0, s).to(device)
                self.cache.kv[layer, kind].index_copy_(0, d, rows)


class SharedMemoryAttacher:
    """PeerAttacher (kvtransfer/handshake.py): maps the shared-memory KV of senders
    on this host into a receiver with ``cache``; mappings are kept per file."""

    same_host = True

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self._peers: dict[str, KVCache] = {}

    def can_attach(self, offer: pb.KVOffer) -> bool:
        return bool(not offer.nixl_metadata and offer.shm_path and offer.host_id == host_id()
                    and SHM_NAME.fullmatch(offer.shm_path) and os.path.exists(offer.shm_path))

    def attach(self, offer: pb.KVOffer) -> SharedMemorySource:
        with self._lock:
            peer = self._peers.get(offer.shm_path)
            if peer is None or peer.num_blocks != offer.num_blocks:
                peer = KVCache.attach(self.cache.layout, offer.num_blocks, offer.shm_path)
                self._peers[offer.shm_path] = peer
            return SharedMemorySource(peer, self.cache)


class LocalKVSender(ChannelSender):
    """Offers its shared-memory KV to receivers on this host; frames then carry block ids only."""

    name = Transport.LOCAL

    def __init__(self, cache: KVCache, cfg: TransferConfig | None = None) -> None:
        if not cache.shm_path:
            raise ValueError("the local transport needs the sender's KV cache in shared memory (shm_path)")
        super().__init__(cache, dataclasses.replace(cfg or TransferConfig(), offer_memory=True),
                         SharedMemoryOffer(cache))
