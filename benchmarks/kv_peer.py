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

``kvrelay bench kv`` forks its peers from a process that imported this module
once (:func:`serve`, multiprocessing's forkserver): a peer's imports (torch,
NIXL, the transports: ~3 s) are not paid again for each of them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

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


Announce = Callable[[str], None]
"""How a peer says it is ready (its ENDPOINT or SENT line): printed, or sent to the bench that forked it."""


def _print(line: str) -> None:
    print(line, flush=True)


def mooncake_target(nbytes: int, announce: Announce) -> None:
    engine = mooncake_engine()
    buf = torch.ones(nbytes, dtype=torch.uint8)
    if engine.register_memory(buf.data_ptr(), nbytes) != 0:
        raise RuntimeError("Mooncake failed to register memory")
    announce(f"ENDPOINT 127.0.0.1:{engine.get_rpc_port()} {buf.data_ptr()}")
    time.sleep(3600)


def nixl_target(nbytes: int, announce: Announce) -> None:
    """A bare NIXL agent (the same progress-thread setting as ours) with NBYTES registered."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = make_agent(nixl_agent, nixl_agent_config, "bare-target")
    buf = torch.ones(nbytes, dtype=torch.uint8)
    agent.register_memory(buf)
    announce(f"ENDPOINT {agent.get_agent_metadata().hex()} {buf.data_ptr()}")
    time.sleep(3600)


def run(argv: list[str], announce: Announce = _print) -> None:
    """The peer ``argv`` (the command line above, without the program) asks for; serves until killed."""
    global HOST
    for a in [a for a in argv if a.startswith("host=")]:
        argv.remove(a)
        HOST = a.split("=", 1)[1]
    role = argv[0]
    if role == "nixl-target":
        nixl_target(int(argv[1]), announce)
        return
    if role == "mooncake-target":
        mooncake_target(int(argv[1]), announce)
        return
    spec = argv[1]
    if role == "receiver":
        cache = make_cache(spec, seed=None)
        rx: NixlKVReceiver | TcpKVReceiver
        if len(argv) > 3 and argv[3] == "nixl":
            rx = NixlKVReceiver(cache, HOST, cfg=RECEIVER)
        else:
            rx = TcpKVReceiver(cache, HOST, cfg=RECEIVER)
        for i in range(int(argv[2])):
            rx.expect(f"t{i}", list(range(cache.num_blocks)))
        announce(f"ENDPOINT {rx.endpoint}")
        time.sleep(3600)
    else:
        cache = make_cache(spec)
        endpoint, tid, n, layers = argv[2], argv[3], int(argv[4]), int(argv[5])
        tx = TcpKVSender(cache, TransferConfig(secret=SECRET, streams=1))
        h = tx.open(TransferTarget(endpoint, tid, tuple(range(n)), cache.layout.compat_hash()))
        for layer in range(layers):
            h.send_layer(layer, list(range(n)), 0)
        time.sleep(1.0)
        announce("SENT")
        time.sleep(3600)


def serve(argv: list[str], conn: Connection) -> None:
    """A peer forked by the bench (multiprocessing's forkserver): its ready line goes to ``conn``; what NIXL
    or Mooncake print goes nowhere (a peer run from the command line prints it: nobody reads it there either)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    run(argv, conn.send)


if __name__ == "__main__":
    run(sys.argv[1:])
