"""Local transport, for workers on the same host: the prefill worker's KV
cache lives in a shared-memory file (/dev/shm/kvrelay-*), and the decode
worker copies the blocks it is told about straight from it into its own
reserved blocks (one memcpy, no bytes on a socket). Control frames (the
authenticated handshake, block lists with their CRC32C, done and its
acknowledgement) use the TCP transport's connection, and the receiver is the
TCP receiver: it serves both kinds of sender. A receiver on another host
simply gets the bytes over TCP."""

from __future__ import annotations

import dataclasses

from engine.kv_cache import KVCache
from kvtransfer.tcp import TcpConfig, TcpKVSender


def shm_path_for(worker_id: str, pid: int) -> str:
    """The shared-memory file name of a worker's KV cache."""
    safe = worker_id.replace("/", "-")
    return f"/dev/shm/kvrelay-{safe}-{pid}"


class LocalKVSender(TcpKVSender):
    name = "local"

    def __init__(self, cache: KVCache, cfg: TcpConfig | None = None) -> None:
        if not cache.shm_path:
            raise ValueError("the local transport needs the sender's KV cache in shared memory (shm_path)")
        super().__init__(cache, dataclasses.replace(cfg or TcpConfig(), shared_memory=True))
