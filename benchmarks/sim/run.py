"""``kvrelay sim``: one simulated run of a trace on a deployment, reported
exactly as a live ``kvrelay bench replay`` is (benchmarks/replay.py's
report.json / report.md, benchmarks/metrics.py's definitions)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from kvrelay.benchmarks.replay import assemble_report
from kvrelay.benchmarks.sim.cluster import SimCluster, SimConfig
from kvrelay.benchmarks.sim.profile import Profile
from kvrelay.benchmarks.sim.workload import SimArrival
from kvrelay.runtime.config import ClusterConfig


@dataclass(slots=True)
class Objectives:
    ttft_s: float | None = None
    tpot_s: float | None = None


def worker_rows(cluster: SimCluster, duration: float) -> dict[str, dict]:
    rows = {}
    for wid, w in sorted(cluster.workers.items()):
        w.refresh()  # closes the KV-usage integral at the end
        u, pool = w.usage, w.pool
        rows[wid] = {"site": w.view.site, "role": w.view.role.value,
                     "busy_fraction": min(1.0, u.busy_s / duration) if duration else 0.0,
                     "kv_usage_mean": u.kv_block_s / duration if duration else 0.0, "kv_usage_max": u.kv_max,
                     "prefill_tokens": u.prefill_tokens, "decode_tokens": u.decode_tokens,
                     "prefix_hit_rate": pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else 0.0}
    return rows


def simulate(cfg: ClusterConfig, profile: Profile, arrivals: list[SimArrival], sim: SimConfig,
             slo: Objectives, meta: dict) -> dict:
    """Runs the simulation; the report (``meta`` merged into its meta)."""
    t0 = time.perf_counter()
    cluster = SimCluster(cfg, profile, sim)
    records = cluster.run(arrivals)
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.end_s for r in records if r.end_s is not None), default=start)
    meta = meta | {"simulated": True, "policy": str(cfg.router.placement.policy), "profile": profile.describe(),
                   "sim": asdict(sim), "workers": len(cluster.workers), "sites": len(cfg.sites),
                   "kv_blocks_per_worker": cluster.num_blocks, "events": cluster.clock.events,
                   "wall_s": time.perf_counter() - t0,
                   "links": link_rows(cluster, end - start), "rate_changes": rate_tracking(cluster, sim)}
    return assemble_report(records, worker_rows(cluster, end - start), slo.ttft_s, slo.tpot_s, meta)


def link_rows(cluster: SimCluster, duration: float) -> dict[str, dict]:
    """Per link between sites: bytes, busy share, and its figures at the end (configured, measured, in use)."""
    out = {}
    for ln in cluster.links.values():
        fig = cluster.meter.status(ln.name)
        row: dict[str, float | str] = {"bytes": ln.bytes_sent, "busy_fraction": ln.busy_s / max(duration, 1e-9)}
        if fig is not None:
            row |= {"configured_gbps": fig.configured_gbps, "measured_gbps": fig.estimate.gbps,
                    "rate_samples": fig.estimate.samples, "placement_gbps": fig.gbps, "rate_source": fig.source.value}
        out[ln.name] = row
    return out


TRACKED = 0.10
"""A link's estimate tracks a change once within this share of the new rate."""


def rate_tracking(cluster: SimCluster, sim: SimConfig) -> list[dict]:
    """Per rate change: the transfers across its link after it, and how many of them (and how long) until
    the rate placement uses was within TRACKED of the new one (None: not within the run)."""
    out = []
    for rc in sim.rate_changes:
        after = [(s, used) for link, s, used in cluster.samples if link == rc.link and s.at >= rc.at_s]
        hit = next((i for i, (_, used) in enumerate(after) if abs(used / rc.gbps - 1) <= TRACKED), None)
        out.append({"link": rc.link, "at_s": rc.at_s, "gbps": rc.gbps, "transfers_after": len(after),
                    "bound_after": sum(s.bound for s, _ in after),
                    "transfers_to_track": None if hit is None else hit + 1,
                    "seconds_to_track": None if hit is None else after[hit][0].at - rc.at_s})
    return out
