"""TCP KV transport: our own, zero-copy, several streams per peer; the KV
bytes cross the socket.

Sender: per receiver endpoint a pool of ``streams`` authenticated
connections (kvtransfer/channel.py), each with a writer thread (sealed
records, kvtransfer/record.py: each payload piece sealed straight from the
KV tensor's memory) and a reader thread (acknowledgements). Layers go to
the least-loaded stream once a transfer's stream has 4 MiB queued.

Receiver (kvtransfer/receiver.py): opens each piece straight into the
reserved blocks' memory (the AEAD tag authenticates every byte). It also
serves local senders: it maps their shared-memory KV (kvtransfer/local.py)
and copies from it.
"""

from __future__ import annotations

from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import Transport
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.local import SharedMemoryAttacher, SharedMemoryOffer
from kvrelay.kvtransfer.receiver import ChannelReceiver
from kvrelay.kvtransfer.sender import ChannelSender


class TcpKVSender(ChannelSender):
    """Bytes over the socket. With ``cfg.offer_memory`` and a cache in shared
    memory it offers that memory to same-host receivers, as a local sender does."""

    name = Transport.TCP

    def __init__(self, cache: KVCache, cfg: TransferConfig | None = None) -> None:
        super().__init__(cache, cfg, SharedMemoryOffer(cache) if cache.shm_path else None)


class TcpKVReceiver(ChannelReceiver):
    """Receives bytes from tcp senders and pulls from the shared memory of local ones."""

    name = Transport.TCP

    def __init__(self, cache: KVCache, host: str = "127.0.0.1", cfg: TransferConfig | None = None) -> None:
        super().__init__(cache, host, cfg, (SharedMemoryAttacher(cache),))
