"""``kvrelay bench kv``: KV transfer throughput between two processes on
loopback, side by side in one run with the limits (raw sockets with the
same stream count, memcpy), the one-block latency, and the layer-wise
overlap of a 4k-token prefill.

KV uses SmolLM2-135M-Instruct's fp32 layout (30 layers, 3 KV heads, head
dim 64, 16-token blocks: 720 KiB per block over all layers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.kv_peer import SECRET, mooncake_engine
from engine.blocks import blocks_for
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_cache import KVCache, KVLayout
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer.base import TransferState, TransferTarget
from kvtransfer.config import TransferConfig
from kvtransfer.nixl import NixlKVSender, nixl_available
from kvtransfer.tcp import TcpKVSender
from prefill_worker.streamer import LayerStreamer

LAYOUT = KVLayout("peer", "float32", 30, 3, 64, 16)
PER_BLOCK = 2 * LAYOUT.num_layers * LAYOUT.block_bytes


@dataclass(slots=True)
class KVBenchResult:
    rows: list[dict] = field(default_factory=list)
    one_block_ms: float = 0.0
    overlap: dict | None = None


def _spec(n: int) -> str:
    return f"float32,{LAYOUT.num_layers},{LAYOUT.num_kv_heads},{LAYOUT.head_dim},{LAYOUT.block_size},{n}"


def _peer(*args: str, full: bool = False) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.kv_peer", *args], stdout=subprocess.PIPE, text=True)
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
    code = f"import json; from benchmarks.kv_bench import ours; print(json.dumps(ours({n_blocks}, 1, {repeat}, 'nixl')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"NIXL over TCP failed: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ours(n_blocks: int, streams: int, repeat: int, transport: str = "tcp", encrypt: bool = False) -> list[float]:
    """Seconds per transfer of ``n_blocks`` (every layer) with our TCP or NIXL backend."""
    src = KVCache(LAYOUT, n_blocks)
    src.kv.normal_()
    proc, endpoint = _peer("receiver", _spec(n_blocks), str(repeat + 1), transport)
    if transport == "nixl":

        tx = NixlKVSender(src, TransferConfig(secret=SECRET, streams=streams))
    else:
        tx = TcpKVSender(src, TransferConfig(secret=SECRET, streams=streams, encrypt=encrypt))
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


def raw(nbytes: int, streams: int, repeat: int) -> list[float]:
    """Seconds per round of sendall/recv_into of ``nbytes`` over ``streams`` sockets."""
    proc, endpoint = _peer("raw-receiver", str(nbytes), str(streams), str(repeat))
    host, port = endpoint.split(":")
    buf = memoryview(bytearray(nbytes))
    share = nbytes // streams
    times = []
    try:
        for _ in range(repeat):
            socks = [socket.create_connection((host, int(port))) for _ in range(streams)]
            t = time.perf_counter()

            def push(i: int) -> None:
                end = nbytes if i == streams - 1 else (i + 1) * share
                socks[i].sendall(buf[i * share:end])
                socks[i].recv(1)

            ts = [threading.Thread(target=push, args=(i,)) for i in range(streams)]
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            times.append(time.perf_counter() - t)
            for s in socks:
                s.close()
    finally:
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
    tx = TcpKVSender(src, TransferConfig(secret=SECRET, streams=4))
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


def run_kv_bench(sizes_mib: list[int], streams: list[int], repeat: int, model_path: Path | None) -> KVBenchResult:
    res = KVBenchResult()
    for mib in sizes_mib:
        n = max(1, round(mib * 2**20 / PER_BLOCK))
        nbytes = n * PER_BLOCK
        row = {"mib": mib, "bytes": nbytes, "memcpy": nbytes / min(memcpy(nbytes, repeat)) / 1e9}
        for s in streams:
            row[f"ours_{s}"] = nbytes / statistics.median(ours(n, s, repeat)) / 1e9
            row[f"raw_{s}"] = nbytes / statistics.median(raw(nbytes, s, repeat)) / 1e9
        if nixl_available():
            row["nixl"] = nbytes / statistics.median(ours(n, 1, repeat, "nixl")) / 1e9
            row["nixl_tcp"] = nbytes / statistics.median(nixl_over_tcp(n, repeat)) / 1e9
        if mooncake_available():
            row["mooncake"] = nbytes / statistics.median(mooncake(nbytes, repeat)) / 1e9
        row["enc"] = nbytes / statistics.median(ours(n, streams[-1], repeat, encrypt=True)) / 1e9
        res.rows.append(row)
    res.one_block_ms = one_block_latency_ms()
    if model_path is not None:
        res.overlap = layerwise_overlap(model_path)
    return res


def format_kv(res: KVBenchResult, streams: list[int]) -> str:
    head = "| KV size | " + " | ".join(f"ours {s} stream{'s' * (s > 1)} | raw {s} | ratio" for s in streams) \
           + f" | ours {streams[-1]} streams encrypted | our nixl (UCX defaults) | our nixl (UCX_TLS=tcp) " \
             "| Mooncake tcp (ours best / it) | memcpy |"
    lines = ["## kv bench: two processes on loopback, GB/s (median)", "", head,
             "|" + "---|" * (6 + 3 * len(streams))]
    for r in res.rows:
        cells = []
        for s in streams:
            cells += [f"{r[f'ours_{s}']:.2f}", f"{r[f'raw_{s}']:.2f}", f"{r[f'ours_{s}'] / r[f'raw_{s}']:.0%}"]
        nixl = f"{r['nixl']:.2f} | {r['nixl_tcp']:.2f}" if "nixl" in r else "not installed | not installed"
        best = max(r[f"ours_{s}"] for s in streams)
        moon = f"{r['mooncake']:.2f} ({best / r['mooncake']:.1f}x)" if "mooncake" in r else "not installed"
        enc = f"{r['enc']:.2f} ({r['enc'] / r[f'ours_{streams[-1]}']:.0%})"
        lines.append(f"| {r['bytes'] / 2**20:.1f} MiB | " + " | ".join(cells) + f" | {enc} | {nixl} | {moon} | "
                     f"{r['memcpy']:.1f} |")
    lines.append("")
    lines.append(f"one block (all 30 layers, {PER_BLOCK // 1024} KiB), warm connections: {res.one_block_ms:.2f} ms")
    if res.overlap:
        o = res.overlap
        lines.append(f"layer-wise overlap, {o['prompt_tokens']}-token prompt ({o['kv_bytes'] / 2**20:.0f} MiB of KV): "
                     f"tail after prefill {o['layerwise']['tail_s'] * 1e3:.0f} ms with layer-wise streaming vs "
                     f"{o['after']['tail_s'] * 1e3:.0f} ms for a whole-cache copy after prefill "
                     f"-> {o['fraction']:.1%} (prefill itself {o['layerwise']['prefill_s']:.1f} s)")
    return "\n".join(lines)
