"""``kvrelay bench placement``: how long the router takes to decide.

A constructed cluster of N workers over S sites (half prefill, half decode,
full mesh of links), random loads and measured throughputs; a prefix index
where every worker holds the leading blocks of some of P shared 8k-token
prompts. Per decision: the prompt's block hashes, the prefix-index lookup
(leading blocks per worker), and ``place`` under each policy. Reported as
p50/p99 in microseconds over many decisions.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from kvrelay.engine.hashing import hash_blocks
from kvrelay.router.placement.place import (
    POLICIES,
    ClusterView,
    LinkView,
    PlacementRequest,
    WorkerView,
    make_policy,
)
from kvrelay.router.placement.prefix_index import PrefixIndex
from kvrelay.runtime.roles import Role


@dataclass(slots=True)
class PlacementBenchResult:
    workers: int
    sites: int
    prompt_tokens: int
    index_blocks: int
    timings_us: dict[str, tuple[float, float]] = field(default_factory=dict)
    """name -> (p50, p99) in microseconds."""
    decision_us: tuple[float, float] = (0.0, 0.0)
    """(p50, p99) of the whole decision under cost_model: hashes + lookup + place, summed per decision."""
    on_loop_us: tuple[float, float] = (0.0, 0.0)
    """(p50, p99) of lookup + place: the part the live router runs on its event loop
    (it hashes the prompt with its tokens, in the tokenizer threads)."""

    def to_json(self) -> dict:
        """Stable field names: hashing, lookup, place (cost_model), decision (their sum per decision)."""
        t = self.timings_us
        pick = {"hashing": t["block hashes (router side)"], "lookup": t["prefix-index lookup"],
                "place": t["place (cost_model)"], "decision": self.decision_us, "on_loop": self.on_loop_us}
        return {"workers": self.workers, "sites": self.sites, "prompt_tokens": self.prompt_tokens,
                "index_entries": self.index_blocks,
                **{f"{k}_{q}_us": v[i] for k, v in pick.items() for i, q in enumerate(("p50", "p99"))},
                "policies_us": {k: {"p50": v[0], "p99": v[1]} for k, v in t.items()}}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def build(n_workers: int, n_sites: int, n_prompts: int, prompt_tokens: int, seed: int = 0):
    rng = random.Random(seed)
    sites = [f"site{i}" for i in range(n_sites)]
    workers = []
    for i in range(n_workers):
        role = Role.PREFILL if i % 2 == 0 else Role.DECODE
        workers.append(WorkerView(
            f"w{i}", role, sites[i % n_sites], inflight=rng.randrange(0, 8),
            queued_prefill_tokens=rng.randrange(0, 20000),
            running=rng.randrange(0, 32), waiting=rng.randrange(0, 4), free_blocks=rng.randrange(600, 5000),
            prefill_tokens_per_s=rng.choice([2000.0, 8000.0, 30000.0]), decode_step_s=rng.uniform(0.01, 0.05)))
    links = {frozenset((a, b)): LinkView(rng.uniform(1, 80), rng.choice([1.0, 10.0, 100.0]))
             for i, a in enumerate(sites) for b in sites[i + 1:]}
    view = ClusterView(workers, {s: "CA" for s in sites}, links, LinkView(0.2, 25.0), block_size=16,
                       kv_block_bytes=2 * 32 * 16 * 8 * 128 * 2, num_layers=32)
    index = PrefixIndex()
    prompts = [[rng.randrange(0, 128000) for _ in range(prompt_tokens)] for _ in range(n_prompts)]
    chains = [hash_blocks(p, 16) for p in prompts]
    for w in workers:
        for chain in rng.sample(chains, k=min(3, len(chains))):
            index.apply(w.worker_id, chain[:rng.randrange(1, len(chain))], [])
    return view, index, prompts


def run_placement_bench(n_workers: int = 1000, n_sites: int = 10, prompt_tokens: int = 8192,
                        decisions: int = 500, n_prompts: int = 20) -> PlacementBenchResult:
    view, index, prompts = build(n_workers, n_sites, n_prompts, prompt_tokens)
    res = PlacementBenchResult(n_workers, n_sites, prompt_tokens, sum(index.blocks_of(w.worker_id)
                                                                      for w in view.workers))
    rng = random.Random(1)
    hashing, lookup = [], []
    reqs = []
    for i in range(decisions):
        prompt = prompts[i % len(prompts)] if i % 2 == 0 else [rng.randrange(0, 128000) for _ in range(prompt_tokens)]
        t0 = time.perf_counter()
        hashes = hash_blocks(prompt, 16)
        t1 = time.perf_counter()
        cached = index.leading_blocks(hashes)
        t2 = time.perf_counter()
        hashing.append((t1 - t0) * 1e6)
        lookup.append((t2 - t1) * 1e6)
        reqs.append(PlacementRequest(prompt_tokens, cached))
    res.timings_us["block hashes (router side)"] = (statistics.median(hashing), _pct(hashing, 0.99))
    res.timings_us["prefix-index lookup"] = (statistics.median(lookup), _pct(lookup, 0.99))
    for name in POLICIES:
        policy = make_policy(name, 0)
        times = []
        for req in reqs:
            t0 = time.perf_counter()
            policy.place(req, view)
            times.append((time.perf_counter() - t0) * 1e6)
        res.timings_us[f"place ({name})"] = (statistics.median(times), _pct(times, 0.99))
        if name == "cost_model":
            total = [h + lk + p for h, lk, p in zip(hashing, lookup, times)]
            res.decision_us = (statistics.median(total), _pct(total, 0.99))
            loop = [lk + p for lk, p in zip(lookup, times)]
            res.on_loop_us = (statistics.median(loop), _pct(loop, 0.99))
    return res


def format_placement(res: PlacementBenchResult) -> str:
    lines = [f"## placement: {res.workers} workers over {res.sites} sites, {res.prompt_tokens}-token prompts, "
             f"prefix index of {res.index_blocks} (worker, block) entries", "",
             "| step | p50 us | p99 us |", "|---|---|---|"]
    for name, (p50, p99) in res.timings_us.items():
        lines.append(f"| {name} | {p50:.0f} | {p99:.0f} |")
    lines.append(f"| **decision** (hashes + lookup + place, cost_model) | {res.decision_us[0]:.0f} | "
                 f"{res.decision_us[1]:.0f} |")
    lines.append(f"| of which on the router's event loop (lookup + place) | {res.on_loop_us[0]:.0f} | "
                 f"{res.on_loop_us[1]:.0f} |")
    return "\n".join(lines)
