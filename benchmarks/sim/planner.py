"""``kvrelay plan capacity``: the fewest accelerators that meet the SLO
attainment on a trace, found by simulating candidate deployments.

For each shape (disaggregated with every configured link, disaggregated
with local links only, colocated: decode pools only), the search

1. grows: from one decode worker at the first site, adds the worker
   (prefill or decode, at any allowed site) that raises the simulated
   attainment most, until the target is met or every pool is at its
   ``max_replicas``;
2. prunes: removes workers one at a time while the target still holds,
   so that removing any one more worker misses it.

The shape with the fewest workers wins (ties: higher goodput). The reason
is read from the configurations one worker smaller: which objective they
miss (TTFT or TPOT) and on which pool the removed worker sat.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.runtime.config import ClusterConfig
from kvrelay.runtime.roles import Role


class Shape(enum.StrEnum):
    """How the deployment serves a request."""

    DISAGGREGATED = "disaggregated"
    """Prefill and decode pools; KV may cross every configured link."""
    LOCAL_LINKS = "disaggregated-local"
    """Prefill and decode pools; KV never leaves its site (no inter-site link)."""
    COLOCATED = "colocated"
    """Decode pools only: each decode worker computes its own prompts."""


Pools = tuple[tuple[str, int, int], ...]
"""(site, prefill replicas, decode replicas) per site, in the config's order."""


@dataclass(slots=True)
class Outcome:
    pools: Pools
    shape: Shape
    attainment: float
    goodput_rps: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    ttft_misses: int
    tpot_misses: int
    failed: int

    @property
    def workers(self) -> int:
        return sum(p + d for _, p, d in self.pools)


@dataclass(slots=True)
class PlanGoal:
    slo_ttft_s: float
    slo_tpot_s: float
    attainment: float = 0.9
    sites: list[str] | None = None
    """Sites that may get workers (None: every site of the config)."""
    shapes: tuple[Shape, ...] = tuple(Shape)


@dataclass(slots=True)
class Plan:
    best: Outcome | None
    smaller: list[tuple[str, Outcome]] = field(default_factory=list)
    """(which worker was removed, its outcome) for every configuration one worker smaller."""
    tried: list[Outcome] = field(default_factory=list)
    """Every configuration simulated (for the cost/goodput plot)."""
    reason: str = ""


def deployment(base: ClusterConfig, pools: Pools, shape: Shape) -> ClusterConfig:
    """``base`` with the pools' sizes (and, for LOCAL_LINKS, no inter-site links)."""
    cfg = copy.deepcopy(base)
    sizes = {s: (p, d) for s, p, d in pools}
    for site in cfg.sites:
        p, d = sizes.get(site.name, (0, 0))
        site.prefill.replicas, site.decode.replicas = p, d
    if shape is not Shape.DISAGGREGATED:
        cfg.links = []
    return cfg


Simulate = Callable[[ClusterConfig], dict]
"""Runs one simulation of a deployment; its report."""


class Planner:
    def __init__(self, base: ClusterConfig, goal: PlanGoal, simulate: Simulate) -> None:
        self.base, self.goal, self.simulate = base, goal, simulate
        names = [s.name for s in base.sites]
        self.sites = [s for s in names if goal.sites is None or s in goal.sites]
        self.limits = {s.name: (s.prefill.max_replicas, s.decode.max_replicas) for s in base.sites}
        self.cache: dict[tuple[Pools, Shape], Outcome] = {}
        self.tried: list[Outcome] = []

    def outcome(self, pools: Pools, shape: Shape) -> Outcome:
        key = (pools, shape)
        if key not in self.cache:
            rep = self.simulate(deployment(self.base, pools, shape))
            s = rep["summary"]
            ttft_miss = tpot_miss = 0
            for r in rep["requests"]:
                if r["error"] is None and r["token_times"]:
                    ttft = r["token_times"][0] - r["sent_s"]
                    ttft_miss += ttft > self.goal.slo_ttft_s
                    n = len(r["token_times"])
                    if n > 1 and (r["end_s"] - r["token_times"][0]) / (n - 1) > self.goal.slo_tpot_s:
                        tpot_miss += 1
            self.cache[key] = Outcome(pools, shape, s["slo_attainment"], s["goodput_rps"],
                                      s["ttft_ms"].get("p90", float("inf")), s["tpot_ms"].get("p90", float("inf")),
                                      ttft_miss, tpot_miss, s["failed"])
            self.tried.append(self.cache[key])
        return self.cache[key]

    def _meets(self, o: Outcome) -> bool:
        return o.attainment >= self.goal.attainment

    def _start(self) -> Pools:
        first = self.sites[0]
        return tuple((s.name, 0, 1 if s.name == first else 0) for s in self.base.sites)

    def _moves(self, pools: Pools, shape: Shape, grow: bool) -> list[tuple[str, Pools]]:
        """Pools one worker larger (grow) or smaller, each with a label "site/role"."""
        out = []
        for i, (site, p, d) in enumerate(pools):
            if site not in self.sites:
                continue
            roles = [(Role.DECODE, 2)] + ([] if shape is Shape.COLOCATED else [(Role.PREFILL, 1)])
            for role, k in roles:
                row: list[Any] = [site, p, d]
                row[k] += 1 if grow else -1
                cap = self.limits[site][k - 1]
                if row[k] < 0 or row[k] > cap:
                    continue
                new = pools[:i] + (tuple(row),) + pools[i + 1:]
                if sum(x[2] for x in new) >= 1:  # a decode worker somewhere
                    out.append((f"{site}/{role.value}", new))
        return out

    def _grow(self, shape: Shape) -> Pools | None:
        pools = self._start()
        while not self._meets(self.outcome(pools, shape)):
            moves = self._moves(pools, shape, grow=True)
            if not moves:
                return None
            pools = max(moves, key=lambda m: (self.outcome(m[1], shape).attainment,
                                              self.outcome(m[1], shape).goodput_rps))[1]
        return pools

    def _prune(self, pools: Pools, shape: Shape) -> Pools:
        while True:
            fits = [m for m in self._moves(pools, shape, grow=False) if self._meets(self.outcome(m[1], shape))]
            if not fits:
                return pools
            pools = max(fits, key=lambda m: self.outcome(m[1], shape).goodput_rps)[1]

    def plan(self) -> Plan:
        best = None
        for shape in self.goal.shapes:
            if shape is Shape.LOCAL_LINKS and not self.base.links:
                continue
            grown = self._grow(shape)
            if grown is None:
                continue
            pruned = self._prune(grown, shape)
            if not any(p for _, p, _ in pruned):  # no prefill worker left: it is a colocated deployment
                shape = Shape.COLOCATED
            o = self.outcome(pruned, shape)
            if best is None or (o.workers, -o.goodput_rps) < (best.workers, -best.goodput_rps):
                best = o
        if best is None:
            return Plan(None, tried=self.tried, reason="no configuration within every pool's max_replicas meets "
                                                       f"{self.goal.attainment:.0%} attainment")
        smaller = [(label, self.outcome(p, best.shape)) for label, p in self._moves(best.pools, best.shape, False)]
        return Plan(best, smaller, self.tried, self._reason(best, smaller))

    def _reason(self, best: Outcome, smaller: list[tuple[str, Outcome]]) -> str:
        if not smaller:
            return "the smallest possible deployment (one decode worker) already meets the objectives"
        label, nearest = max(smaller, key=lambda s: s[1].attainment)
        bound = "TTFT" if nearest.ttft_misses >= nearest.tpot_misses else "TPOT"
        return (f"{bound}-bound: without one worker of {label} (the least harmful removal) attainment drops to "
                f"{nearest.attainment:.1%} < {self.goal.attainment:.0%} ({nearest.ttft_misses} requests miss "
                f"TTFT <= {self.goal.slo_ttft_s:g} s, {nearest.tpot_misses} miss TPOT <= {self.goal.slo_tpot_s:g} s"
                f"{f', {nearest.failed} fail' if nearest.failed else ''})")
