"""``kvrelay bench routers``: one router against one per site on the same workload.

Two clusters in turn, identical but for their routers: one router, then three
(one per site, sharing a 3-member etcd). Each gets the same slice of a trace
whose prompts share prefixes (Mooncake's ``hash_ids``: 512-token blocks,
scaled), one request at a time; with three routers the requests go to each in
turn, so a prefix one router's request cached is found by the next router's.
Reported per run: the prefix hit rate (prompt tokens the workers found cached
over prompt tokens, from each answer's usage), TTFT (mean, p90), and where
prompts were prefilled."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from kvrelay.benchmarks.traces import build_prompts, load_trace
from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

ROUTERS = [{"name": "qc", "site": "montreal"}, {"name": "ont", "site": "toronto"},
           {"name": "bc", "site": "vancouver"}]
VOCAB = (200, 49_000)
"""Token ids the prompts are drawn from (inside SmolLM2's vocabulary)."""


def config(several: bool) -> dict:
    """Two sites with a prefill and a decode worker each, a third without workers; one router, or three."""
    raw = {
        "router": {"port": 0, "http_port": None, "liveness": {"heartbeat_interval_s": 0.25},
                   "placement": {"policy": "cost_model", "colocate_below_tokens": 0}},
        "sites": [{"name": s, "jurisdiction": j, "prefill": {"replicas": n}, "decode": {"replicas": n}}
                  for s, j, n in (("montreal", "CA-QC", 1), ("toronto", "CA-ON", 1), ("vancouver", "CA-BC", 0))],
        "links": [{"between": ["montreal", "toronto"], "rtt_ms": 9, "gbps": 10},
                  {"between": ["toronto", "vancouver"], "rtt_ms": 60, "gbps": 10}],
        "workers": {"threads": 1},
        "cache": {"memory_gib": 0.5},
    }
    if several:
        raw["routers"] = ROUTERS
    return raw


def _send(lc: LocalCluster, address: str, prompt: list[int], max_tokens: int) -> ipb.Finish:
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=prompt), max_tokens=max_tokens, ignore_eos=True)
    with lc.client_dialer.sync(address) as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=600))
    return msgs[-1].finish


def run_once(model: Path, prompts, several: bool) -> dict:
    """One cluster, the prompts in order (round-robin over its routers); its figures."""
    lc = LocalCluster(parse_config(config(several)), model)
    lc.start()
    try:
        addresses = [r.address for r in lc.routers.values()]
        _send(lc, addresses[0], [VOCAB[0] + 7] * 64, 2)  # the workers' first steps are not measured
        rows = []
        t0 = time.monotonic()
        for i, p in enumerate(prompts):
            fin = _send(lc, addresses[i % len(addresses)], p.prompt, p.max_tokens)
            rows.append((fin.usage.prompt_tokens, fin.usage.cached_prompt_tokens, fin.placement.ttft_ms,
                         fin.placement.prefill_worker))
        wall = time.monotonic() - t0
    finally:
        lc.stop()
    prompt, cached = sum(r[0] for r in rows), sum(r[1] for r in rows)
    return {"routers": len(addresses), "requests": len(rows), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "ttft_mean_ms": round(statistics.fmean(r[2] for r in rows), 1),
            "ttft_p90_ms": round(sorted(r[2] for r in rows)[int(0.9 * (len(rows) - 1))], 1),
            "prefill_workers": {w: sum(1 for r in rows if r[3] == w) for w in sorted({r[3] for r in rows})},
            "wall_s": round(wall, 1)}


def run(model: Path, trace: Path, start: int, limit: int, scale: float) -> dict:
    """Both runs on the same prompts (requests ``start`` to ``start + limit`` of the trace); the three
    routers' hit rate as a share of the one router's."""
    reqs = load_trace(trace, limit=start + limit)[start:]
    if not reqs:
        raise ValueError(f"{trace} has no request past the first {start}")
    prompts = build_prompts(reqs, scale, VOCAB, seed=0, out_scale=0.0)  # 1 output token: the prompts are the load
    one, three = run_once(model, prompts, False), run_once(model, prompts, True)
    ratio = three["prefix_hit_rate"] / one["prefix_hit_rate"] if one["prefix_hit_rate"] else None
    return {"trace": str(trace), "start": start, "limit": limit, "scale": scale, "one_router": one,
            "three_routers": three, "hit_rate_three_over_one": round(ratio, 4) if ratio is not None else None}


def markdown(report: dict) -> str:
    """The report as a table for benchmarks/RESULTS.md."""
    head = ("| routers | requests | prompt tokens | cached | prefix hit rate | TTFT mean ms | TTFT p90 ms "
            "| prefills per worker |\n|---|---|---|---|---|---|---|---|\n")
    rows = "".join(f"| {r['routers']} | {r['requests']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                   f"{r['prefix_hit_rate']:.1%} | {r['ttft_mean_ms']} | {r['ttft_p90_ms']} "
                   f"| {', '.join(f'{w} {n}' for w, n in r['prefill_workers'].items())} |\n"
                   for r in (report["one_router"], report["three_routers"]))
    return head + rows + f"\nthree routers' hit rate over one router's: {report['hit_rate_three_over_one']}\n"
