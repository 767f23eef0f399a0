"""A synthetic research network for scale runs of the simulator:
``sites`` cities in ``countries`` jurisdictions on a ring with chords
(each site linked to its neighbours ``1 .. degree/2`` steps away), RTT
growing with the ring distance. ``python -m kvrelay.benchmarks.sim.nren --sites 100
--workers 10000 > nren.yaml`` writes a config ``kvrelay sim`` reads."""

from __future__ import annotations

import argparse
import sys

import yaml


def nren_config(sites: int, workers: int, degree: int = 4, countries: int = 10, prefill_share: float = 0.5,
                gbps: float = 100.0, rtt_ms_per_hop: float = 8.0) -> dict:
    """A kvrelay config dict: ``workers`` split evenly over the sites, ``prefill_share`` of them prefill."""
    per_site = max(1, workers // sites)
    n_prefill = round(per_site * prefill_share)
    names = [f"city{i:03d}" for i in range(sites)]
    out_sites = [{"name": n, "jurisdiction": f"C{i % countries:02d}",
                  "prefill": {"replicas": n_prefill, "max_replicas": per_site},
                  "decode": {"replicas": per_site - n_prefill, "max_replicas": per_site}}
                 for i, n in enumerate(names)]
    links, seen = [], set()
    for i in range(sites):
        for hop in range(1, degree // 2 + 1):
            j = (i + hop) % sites
            key = frozenset((i, j))
            if i != j and key not in seen:
                seen.add(key)
                links.append({"between": [names[i], names[j]], "rtt_ms": rtt_ms_per_hop * hop, "gbps": gbps})
    return {"router": {"placement": {"policy": "cost_model"}, "admission": {"max_inflight_per_worker": 64}},
            "sites": out_sites, "links": links,
            "local_link": {"rtt_ms": 0.05, "gbps": 400.0}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrelay.benchmarks.sim.nren", description=__doc__)
    p.add_argument("--sites", type=int, default=100)
    p.add_argument("--workers", type=int, default=10000)
    p.add_argument("--degree", type=int, default=4, help="links per site")
    p.add_argument("--countries", type=int, default=10)
    a = p.parse_args(argv)
    if min(a.sites, a.workers, a.degree, a.countries) < 1 or a.workers < a.sites:
        print("nren: --sites, --degree, --countries must be >= 1 and --workers >= --sites", file=sys.stderr)
        return 2
    yaml.safe_dump(nren_config(a.sites, a.workers, a.degree, a.countries), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
