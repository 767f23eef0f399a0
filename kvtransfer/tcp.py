"""TCP KV transport: our own, zero-copy, several streams per peer; the KV
bytes cross the socket.

Sender: per receiver endpoint a pool of ``streams`` authenticated
connections (kvtransfer/channel.py), each with a writer thread (frames +
``sendall`` straight from the KV tensor's memory, one call per run of
consecutive blocks) and a reader thread (acknowledgements). Layers go to
the least-loaded stream once a transfer's stream has 4 MiB queued.

Receiver (kvtransfer/receiver.py): ``recv_into``s each run of blocks
straight into the reserved blocks' memory and verifies every block's
CRC32C. It also serves local senders: it maps their shared-memory KV
(kvtransfer/local.py) and copies from it.
"""

from __future__ import annotations

from engine.kv_cache import KVCache
from kvtransfer.base import Transport
from kvtransfer.config import TransferConfig
from kvtransfer.local import SharedMemoryAttacher, SharedMemoryOffer
from kvtransfer.receiver import ChannelReceiver
from kvtransfer.sender import ChannelSender


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
