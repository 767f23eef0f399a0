"""``kvrelay bench kv``: KV transfer throughput between two processes on
loopback, with protection on (aead, the default, and integrity), side by
side in one run with its limits: a plain raw socket, and a raw socket that
does the same cipher work with the same stream count (benchmarks/kv_limit.py;
on loopback both ends share this machine's cores, so the cipher work is part
of the fair limit). Then the peers at the largest size (Mooncake's transfer
engine over TCP, a bare NIXL READ against our NIXL path, memcpy), the
one-block latency, and the layer-wise overlap of a 4k-token prefill.

KV uses SmolLM2-135M-Instruct's fp32 layout (30 layers, 3 KV heads, head
dim 64, 16-token blocks: 720 KiB per block over all layers).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import multiprocessing.process
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrelay.benchmarks import kv_limit, kv_peer
from kvrelay.benchmarks.kv_limit import PLAIN
from kvrelay.benchmarks.kv_peer import SECRET, mooncake_engine
from kvrelay.benchmarks.machine import machine
from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.base import TransferState, TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.nixl import NixlKVSender, make_agent, nixl_available
from kvrelay.kvtransfer.protection import Protection
from kvrelay.kvtransfer.tcp import TcpKVSender
from kvrelay.prefill_worker.streamer import LayerStreamer

LAYOUT = KVLayout("peer", "float32", 30, 3, 64, 16)
PER_BLOCK = 2 * LAYOUT.num_layers * LAYOUT.block_bytes


@dataclass(slots=True)
class KVBenchResult:
    rows: list[dict] = field(default_factory=list)
    """One per (size, streams, mode): see :func:`kv_json`."""
    one_block_ms: float = 0.0
    overlap: dict | None = None
    extra: dict = field(default_factory=dict)
    """Peers and memcpy at the largest size."""
    wan_link_ratio: float | None = None


def _spec(n: int) -> str:
    return f"float32,{LAYOUT.num_layers},{LAYOUT.num_kv_heads},{LAYOUT.head_dim},{LAYOUT.block_size},{n}"


PEER_NETNS: str | None = None
"""Run benchmark peers in this network namespace (benchmarks/kv_wan.py)."""
PEER_HOST: str | None = None
"""The address peers listen on there."""


PEER_START_S = 120.0
"""How long a peer may take to say it is ready (the first forked one includes the forkserver's imports)."""
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["kvrelay.benchmarks.kv_peer"])


class ForkedPeer:
    """A kv_peer forked by multiprocessing's forkserver (which imported kv_peer once), with the
    two calls of ``subprocess.Popen`` the measurements make."""

    __slots__ = ("_proc",)

    def __init__(self, proc: multiprocessing.process.BaseProcess) -> None:
        self._proc = proc

    def kill(self) -> None:
        self._proc.kill()

    def wait(self, timeout: float = 30.0) -> int | None:
        self._proc.join(timeout)
        return self._proc.exitcode


def _forked_peer(args: Sequence[str]) -> tuple[ForkedPeer, str]:
    """A kv_peer forked from the forkserver, and its ready line."""
    ready, theirs = _FORKS.Pipe(duplex=False)
    proc = _FORKS.Process(target=kv_peer.serve, args=(list(args), theirs), daemon=True)
    proc.start()
    theirs.close()
    peer = ForkedPeer(proc)
    try:
        if not ready.poll(PEER_START_S):
            raise RuntimeError(f"benchmark peer {args[0]} did not start within {PEER_START_S:.0f} s")
        return peer, ready.recv()
    except (EOFError, RuntimeError) as exc:
        peer.kill()
        raise RuntimeError(f"benchmark peer {args[0]} failed to start (exit code {peer.wait()}): {exc}") from None
    finally:
        ready.close()


def _peer(*args: str, full: bool = False, module: str = "kv_peer") -> tuple[subprocess.Popen | ForkedPeer, str]:
    """A peer process (``module``: kv_peer, or kv_limit for the raw-socket receiver) and its endpoint:
    forked (kv_peer on this host) or started as a command (kv_limit, a lighter process; or a peer in
    PEER_NETNS, started through ``ip netns exec``)."""
    if module == "kv_peer" and not PEER_NETNS:
        fork, line = _forked_peer(args)
        if not line.startswith("ENDPOINT"):
            fork.kill()
            raise RuntimeError(f"benchmark peer failed to start: {line!r}")
        return fork, (line.split(maxsplit=1)[1].strip() if full else line.split()[1])
    where = ["ip", "netns", "exec", PEER_NETNS] if PEER_NETNS else []
    host = [f"host={PEER_HOST}"] if PEER_HOST else []
    proc = subprocess.Popen([*where, sys.executable, "-m", f"kvrelay.benchmarks.{module}", *args, *host],
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout is None:  # stdout=PIPE
        raise RuntimeError("benchmark peer has no stdout")
    for _ in range(50):  # NIXL and Mooncake log to stdout before the peer is ready
        line = proc.stdout.readline()
        if line.startswith("ENDPOINT") or not line:
            break
    if not line.startswith("ENDPOINT"):
        proc.kill()
        raise RuntimeError(f"benchmark peer failed to start: {line!r}")
    return proc, (line.split(maxsplit=1)[1].strip() if full else line.split()[1])


def mooncake_available() -> bool:
    return importlib.util.find_spec("mooncake") is not None


def mooncake(nbytes: int, repeat: int) -> list[float]:
    """Seconds per READ of ``nbytes`` with the Mooncake transfer engine over TCP
    (a peer to compare against; P2PHANDSHAKE needs no metadata server)."""

    proc, endpoint = _peer("mooncake-target", str(nbytes), full=True)
    remote, addr = endpoint.split()
    engine = mooncake_engine()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    engine.register_memory(buf.data_ptr(), nbytes)
    times = []
    try:
        for i in range(repeat + 1):
            t = time.perf_counter()
            if engine.transfer_sync_read(remote, buf.data_ptr(), int(addr), nbytes) != 0:
                raise RuntimeError("Mooncake read failed")
            if i:  # the first one also connects
                times.append(time.perf_counter() - t)
        if not bool((buf == 1).all()):
            raise RuntimeError("Mooncake delivered wrong bytes")
    finally:
        engine.unregister_memory(buf.data_ptr())
        proc.kill()
        proc.wait()
    return times


def nixl_over_tcp(n_blocks: int, repeat: int) -> list[float]:
    """Our NIXL transport with UCX restricted to TCP (``UCX_TLS=tcp``), in a
    child process because UCX reads its environment once."""
    env = {**os.environ, "UCX_TLS": "tcp"}
    code = ("import json; from benchmarks.kv_bench import ours; "
            f"print(json.dumps(ours({n_blocks}, 1, {repeat}, 'nixl', 'integrity')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"NIXL over TCP failed: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def nixl_bare(nbytes: int, repeat: int) -> list[float]:
    """Seconds per bare NIXL READ of ``nbytes`` (one descriptor, agents set up
    as ours are, metadata passed out of band): what our NIXL path is measured against."""
    from nixl._api import nixl_agent, nixl_agent_config

    proc, endpoint = _peer("nixl-target", str(nbytes), full=True)
    meta, addr = endpoint.split()
    agent = make_agent(nixl_agent, nixl_agent_config, "bare-reader")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    reg = agent.register_memory(buf)
    times = []
    try:
        peer = agent.add_remote_agent(bytes.fromhex(meta))
        peer = peer.decode() if isinstance(peer, bytes) else peer
        local = agent.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(int(addr), nbytes, 0)], "DRAM")
        for i in range(repeat + 1):
            t = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, remote, peer)
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                time.sleep(0.0002)
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state == "ERR":
                raise RuntimeError("bare NIXL read failed")
            if i:
                times.append(time.perf_counter() - t)
        if not bool((buf == 1).all()):
            raise RuntimeError("bare NIXL delivered wrong bytes")
    finally:
        agent.deregister_memory(reg)
        proc.kill()
        proc.wait()
    return times


def ours(n_blocks: int, streams: int, repeat: int, transport: str = "tcp", protection: str = "aead") -> list[float]:
    """Seconds per transfer of ``n_blocks`` (every layer) with our TCP or NIXL backend."""
    src = KVCache(LAYOUT, n_blocks)
    src.kv.normal_()
    proc, endpoint = _peer("receiver", _spec(n_blocks), str(repeat + 1), transport)
    cfg = TransferConfig(secret=SECRET, streams=streams, protection=Protection.parse(protection))
    tx = NixlKVSender(src, cfg) if transport == "nixl" else TcpKVSender(src, cfg)
    times = []
    try:
        for i in range(repeat + 1):
            t = time.perf_counter()
            h = tx.open(TransferTarget(endpoint, f"t{i}", tuple(range(n_blocks)), LAYOUT.compat_hash()))
            for layer in range(LAYOUT.num_layers):
                h.send_layer(layer, list(range(n_blocks)), 0)
            h.finish(0, 0.0)
            if h.wait(300) is not TransferState.DONE:
                raise RuntimeError(f"transfer failed: {h.failure()}")
            if i:  # the first one also opens and authenticates the connections
                times.append(time.perf_counter() - t)
    finally:
        tx.close()
        proc.kill()
        proc.wait()
    return times


def raw(nbytes: int, streams: int, repeat: int, mode: str = PLAIN) -> list[float]:
    """Seconds per round of ``nbytes`` over ``streams`` warm sockets (one
    unmeasured round first, as ours has), doing the cipher work of ``mode``
    (plain, aead, integrity: benchmarks/kv_limit.py)."""
    proc, endpoint = _peer(str(nbytes), str(streams), str(repeat + 1), mode, module="kv_limit")
    host, port = endpoint.rsplit(":", 1)
    buf = memoryview(bytearray(nbytes))
    share = nbytes // streams
    times = []
    socks = [socket.create_connection((host, int(port))) for _ in range(streams)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as ours
    try:
        for r in range(repeat + 1):
            t = time.perf_counter()

            def send(i: int) -> None:
                end = nbytes if i == streams - 1 else (i + 1) * share
                kv_limit.push(socks[i], buf[i * share:end], mode, i)
                socks[i].recv(1)

            ts = [threading.Thread(target=send, args=(i,)) for i in range(streams)]
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            if r:
                times.append(time.perf_counter() - t)
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait()
    return times


def memcpy(nbytes: int, repeat: int) -> list[float]:
    a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return times


def one_block_latency_ms(samples: int = 50) -> float:
    src = KVCache(LAYOUT, 4)
    proc, endpoint = _peer("receiver", _spec(1), str(samples + 1))
    tx = TcpKVSender(src, TransferConfig(secret=SECRET, streams=4))  # aead, the default
    times = []
    try:
        for i in range(samples + 1):
            t = time.perf_counter()
            h = tx.open(TransferTarget(endpoint, f"t{i}", (0,), LAYOUT.compat_hash()))
            for layer in range(LAYOUT.num_layers):
                h.send_layer(layer, [0], 0)
            h.finish(0, 0.0)
            if h.wait(30) is not TransferState.DONE:
                raise RuntimeError(f"transfer failed: {h.failure()}")
            if i:
                times.append(time.perf_counter() - t)
    finally:
        tx.close()
        proc.kill()
        proc.wait()
    return statistics.median(times) * 1e3


def layerwise_overlap(model_path: Path, prompt_tokens: int = 4096) -> dict:
    """Tail after prefill with layer-wise streaming vs a whole-cache copy after prefill."""

    eng = LLMEngine(EngineConfig(model_path=model_path, cache=CacheConfig(memory_gib=0.5,
                                                                          enable_prefix_caching=False),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=1024)))
    layout = eng.layout
    n_blocks = blocks_for(prompt_tokens, layout.block_size)
    spec = f"{layout.dtype},{layout.num_layers},{layout.num_kv_heads},{layout.head_dim},{layout.block_size}," \
           f"{n_blocks},{layout.model}"
    proc, endpoint = _peer("receiver", spec, "3")
    sender = TcpKVSender(eng.cache, TransferConfig(secret=SECRET, streams=4))
    streamer = LayerStreamer(eng.runner, layout.num_layers)
    prompt = torch.randint(0, 40000, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    one = SamplingParams(max_tokens=1)
    out: dict = {"prompt_tokens": prompt_tokens, "kv_bytes": n_blocks * 2 * layout.num_layers * layout.block_bytes}
    try:
        for i, mode in enumerate(("warmup", "layerwise", "after")):
            rid = f"r{i}"
            target = TransferTarget(endpoint, f"t{i}", tuple(range(n_blocks)), layout.compat_hash())
            h = sender.open(target)
            if mode != "after":
                streamer.add(rid, h, 0, n_blocks)
            eng.add_request(rid, prompt, one, hold_blocks=True)
            t0 = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            t_prefill = time.perf_counter()
            if mode == "after":
                blocks = eng.held_blocks(rid)
                if blocks is None:  # hold_blocks=True
                    raise RuntimeError(f"{rid} holds no blocks after its prefill")
                for layer in range(layout.num_layers):
                    h.send_layer(layer, blocks, 0)
            h.finish(0, 0.0)
            if h.wait(300) is not TransferState.DONE:
                raise RuntimeError(f"transfer failed: {h.failure()}")
            t_done = time.perf_counter()
            streamer.remove(rid)
            eng.release_blocks(rid)
            out[mode] = {"prefill_s": t_prefill - t0, "tail_s": t_done - t_prefill}
    finally:
        sender.close()
        proc.kill()
        proc.wait()
    out["fraction"] = out["layerwise"]["tail_s"] / out["after"]["tail_s"]
    return out


def _gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def _rows_for(mib: int, streams: list[int], modes: list[str], repeat: int) -> list[dict]:
    """One record per (streams, mode) at ``mib``: ours, the plain raw socket,
    and the raw socket doing the same protection work (the limit)."""
    n = max(1, round(mib * 2**20 / PER_BLOCK))
    nbytes = n * PER_BLOCK
    rows = []
    for s in streams:
        plain = _gbps(nbytes, raw(nbytes, s, repeat))
        for mode in modes:
            t_ours, t_limit = [], []
            for _ in range(repeat):  # alternating, so both meet the same machine load
                t_ours += ours(n, s, 2, protection=mode)
                t_limit += raw(nbytes, s, 2, mode)
            ours_gbps, limit = _gbps(nbytes, t_ours), _gbps(nbytes, t_limit)
            rows.append({"size_mib": round(nbytes / 2**20, 2), "streams": s, "mode": mode,
                         "ours_gbps": round(ours_gbps, 3), "raw_gbps": round(plain, 3),
                         "limit_gbps": round(limit, 3), "ratio": round(ours_gbps / limit, 3)})
    return rows


def _peers(mib: int, repeat: int) -> dict:
    """The peers at one size: Mooncake's TCP READ, bare NIXL vs our NIXL path, memcpy."""
    n = max(1, round(mib * 2**20 / PER_BLOCK))
    nbytes = n * PER_BLOCK
    out = {"peers_size_mib": round(nbytes / 2**20, 2),
           "memcpy_gbps": round(nbytes / min(memcpy(nbytes, repeat)) / 1e9, 2)}
    if mooncake_available():
        out["mooncake_gbps"] = round(_gbps(nbytes, mooncake(nbytes, repeat)), 3)
    if nixl_available():
        out["nixl_bare_gbps"] = round(_gbps(nbytes, nixl_bare(nbytes, repeat)), 3)
        out["nixl_ours_gbps"] = round(_gbps(nbytes, ours(n, 1, repeat, "nixl", "integrity")), 3)
    return out


def run_kv_bench(sizes_mib: list[int], streams: list[int], repeat: int, model_path: Path | None,
                 modes: Sequence[str] = ("aead", "integrity")) -> KVBenchResult:
    """Every (size, streams, mode) side by side with its limits, then the
    peers at the largest size (the WAN link: benchmarks/kv_wan.py)."""
    res = KVBenchResult()
    for mib in sizes_mib:
        res.rows += _rows_for(mib, streams, list(modes), repeat)
    res.extra = _peers(max(sizes_mib), repeat)
    res.one_block_ms = one_block_latency_ms()
    if model_path is not None:
        res.overlap = layerwise_overlap(model_path)
    return res


def kv_json(res: KVBenchResult, command: str) -> dict:
    """The record ``kvrelay bench kv --json`` writes (field names are stable)."""
    out = {"date": time.strftime("%Y-%m-%d"), "command": command, "machine": machine(), "rows": res.rows,
           "one_block_ms": round(res.one_block_ms, 3),
           "overlap_fraction": round(res.overlap["fraction"], 4) if res.overlap else None,
           "wan_link_ratio": res.wan_link_ratio, **res.extra}
    return out


def format_kv(res: KVBenchResult) -> str:
    lines = ["## kv bench: two processes on loopback, GB/s (median)", "",
             "| KV size | streams | mode | ours | raw socket | raw socket, same cipher work (limit) | ours / limit |",
             "|---|---|---|---|---|---|---|"]
    for r in res.rows:
        lines.append(f"| {r['size_mib']:g} MiB | {r['streams']} | {r['mode']} | {r['ours_gbps']:.2f} | "
                     f"{r['raw_gbps']:.2f} | {r['limit_gbps']:.2f} | {r['ratio']:.0%} |")
    e = res.extra
    lines.append("")
    peers = [f"memcpy {e['memcpy_gbps']:.1f}"]
    if "mooncake_gbps" in e:
        peers.append(f"Mooncake TCP READ {e['mooncake_gbps']:.2f}")
    if "nixl_bare_gbps" in e:
        peers.append(f"bare NIXL READ {e['nixl_bare_gbps']:.2f} vs our NIXL path {e['nixl_ours_gbps']:.2f} "
                     f"({e['nixl_ours_gbps'] / e['nixl_bare_gbps']:.0%})")
    lines.append(f"peers at {e['peers_size_mib']:g} MiB, GB/s: " + "; ".join(peers))
    if res.wan_link_ratio is not None:
        lines.append(f"emulated WAN link (1 Gbit/s, 60 ms RTT), {e['wan_size_mib']:g} MiB, {e['wan_streams']} streams: "
                     f"ours {e['wan_ours_gbps'] * 8:.3f} Gbit/s vs the link's TCP {e['wan_link_tcp_gbps'] * 8:.3f} "
                     f"-> {res.wan_link_ratio:.0%}")
    lines.append(f"one block (all 30 layers, {PER_BLOCK // 1024} KiB, aead), warm connections: "
                 f"{res.one_block_ms:.2f} ms")
    if res.overlap:
        o = res.overlap
        lines.append(f"layer-wise overlap, {o['prompt_tokens']}-token prompt ({o['kv_bytes'] / 2**20:.0f} MiB of KV): "
                     f"tail after prefill {o['layerwise']['tail_s'] * 1e3:.0f} ms with layer-wise streaming vs "
                     f"{o['after']['tail_s'] * 1e3:.0f} ms for a whole-cache copy after prefill "
                     f"-> {o['fraction']:.1%} (prefill itself {o['layerwise']['prefill_s']:.1f} s)")
    return "\n".join(lines)
