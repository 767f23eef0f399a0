"""A KV transport peer in its own process, for benchmarks and for tests that
kill one side. SPEC is ``dtype,layers,kv_heads,head_dim,block_size,num_blocks[,model]``.

    python -m kvrelay.benchmarks.kv_peer receiver SPEC COUNT [tcp|nixl]
        expects transfers t0..t{COUNT-1}, each into every block;
        prints "ENDPOINT host:port", then serves until killed
    python -m kvrelay.benchmarks.kv_peer nixl-target NBYTES
        registers NBYTES with a bare NIXL agent; prints "ENDPOINT hex_metadata address"
    python -m kvrelay.benchmarks.kv_peer mooncake-target NBYTES
        registers NBYTES with a Mooncake transfer engine (P2PHANDSHAKE, tcp)
        and prints "ENDPOINT host:rpc_port buffer_address"
    python -m kvrelay.benchmarks.kv_peer sender SPEC ENDPOINT TRANSFER_ID N_BLOCKS LAYERS
        sends LAYERS layers of N_BLOCKS blocks, prints "SENT", then hangs

Receivers listen on 127.0.0.1, or on ADDR given as ``host=ADDR`` anywhere
on the command line. The raw-socket receiver the limits are measured with is
benchmarks/kv_limit.py (a lighter process: no torch).
"""

from __future__ import annotations

import sys
import time

import torch

from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.nixl import NixlKVReceiver, make_agent
from kvrelay.kvtransfer.protection import Protection
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender

SECRET = b"test-secret"
HOST = "127.0.0.1"
"""Where receivers listen (``host=ADDR`` on the command line: an emulated site's address)."""
RECEIVER = TransferConfig(secret=SECRET, protection=Protection.INTEGRITY)
"""A benchmark receiver accepts senders of either protection (aead satisfies integrity)."""


def make_cache(spec: str, seed: int | None = 5) -> KVCache:
    dtype, *rest = spec.split(",")
    model = rest.pop() if len(rest) == 6 else "peer"
    layers, heads, dim, bs, blocks = (int(x) for x in rest)
    cache = KVCache(KVLayout(model, dtype, layers, heads, dim, bs), blocks)
    if seed is not None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def mooncake_engine():
    """A Mooncake transfer engine over TCP with no metadata server."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake transfer engine failed to initialize")
    return engine


def mooncake_target(nbytes: int) -> None:
    engine = mooncake_engine()
    buf = torch.ones(nbytes, dtype=torch.uint8)
    if engine.register_memory(buf.data_ptr(), nbytes) != 0:
        raise RuntimeError("Mooncake failed to register memory")
    print("ENDPOINT", f"127.0.0.1:{engine.get_rpc_port()}", buf.data_ptr(), flush=True)
    time.sleep(3600)


def nixl_target(nbytes: int) -> None:
    """A bare NIXL agent (the same progress-thread setting as ours) with NBYTES registered."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = make_agent(nixl_agent, nixl_agent_config, "bare-target")
    buf = torch.ones(nbytes, dtype=torch.uint8)
    agent.register_memory(buf)
    print("ENDPOINT", agent.get_agent_metadata().hex(), buf.data_ptr(), flush=True)
    time.sleep(3600)


def main() -> None:
    global HOST
    hosts = [a for a in sys.argv if a.startswith("host=")]
    for a in hosts:
        sys.argv.remove(a)
        HOST = a.split("=", 1)[1]
    role = sys.argv[1]
    if role == "nixl-target":
        nixl_target(int(sys.argv[2]))
        return
    if role == "mooncake-target":
        mooncake_target(int(sys.argv[2]))
        return
    spec = sys.argv[2]
    if role == "receiver":
        cache = make_cache(spec, seed=None)
        rx: NixlKVReceiver | TcpKVReceiver
        if len(sys.argv) > 4 and sys.argv[4] == "nixl":

            rx = NixlKVReceiver(cache, HOST, cfg=RECEIVER)
        else:
            rx = TcpKVReceiver(cache, HOST, cfg=RECEIVER)
        for i in range(int(sys.argv[3])):
            rx.expect(f"t{i}", list(range(cache.num_blocks)))
        print("ENDPOINT", rx.endpoint, flush=True)
        time.sleep(3600)
    else:
        cache = make_cache(spec)
        endpoint, tid, n, layers = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
        tx = TcpKVSender(cache, TransferConfig(secret=SECRET, streams=1))
        h = tx.open(TransferTarget(endpoint, tid, tuple(range(n)), cache.layout.compat_hash()))
        for layer in range(layers):
            h.send_layer(layer, list(range(n)), 0)
        time.sleep(1.0)
        print("SENT", flush=True)
        time.sleep(3600)


if __name__ == "__main__":
    main()
