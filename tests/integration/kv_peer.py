"""A KV transport peer in its own process, for tests that kill one side.

    python -m tests.integration.kv_peer receiver SPEC      -> prints "ENDPOINT host:port", then serves
    python -m tests.integration.kv_peer sender SPEC ENDPOINT TRANSFER_ID N_BLOCKS LAYERS
                                                           -> sends LAYERS layers, prints "SENT", then hangs
SPEC is layers,kv_heads,head_dim,block_size,num_blocks.
"""

from __future__ import annotations

import sys
import time

import torch

from engine.kv_cache import KVCache, KVLayout
from kvtransfer.base import TransferTarget
from kvtransfer.tcp import TcpConfig, TcpKVReceiver, TcpKVSender

SECRET = b"test-secret"


def make_cache(spec: str) -> KVCache:
    layers, heads, dim, bs, blocks = (int(x) for x in spec.split(","))
    cache = KVCache(KVLayout("peer", "float32", layers, heads, dim, bs), blocks)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(5)))
    return cache


def main() -> None:
    role, spec = sys.argv[1], sys.argv[2]
    cache = make_cache(spec)
    if role == "receiver":
        rx = TcpKVReceiver(cache, cfg=TcpConfig(secret=SECRET))
        rx.expect("t1", list(range(cache.num_blocks)))
        print("ENDPOINT", rx.endpoint, flush=True)
        time.sleep(3600)
    else:
        endpoint, tid, n, layers = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
        tx = TcpKVSender(cache, TcpConfig(secret=SECRET, streams=1))
        h = tx.open(TransferTarget(endpoint, tid, tuple(range(n)), cache.layout.compat_hash()))
        for layer in range(layers):
            h.send_layer(layer, list(range(n)), 0)
        time.sleep(1.0)
        print("SENT", flush=True)
        time.sleep(3600)


if __name__ == "__main__":
    main()
