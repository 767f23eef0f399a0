"""Pool-size planner: from the router's own figures over a recent window,
recommends each site's prefill and decode pool size, within the operator's
limits (``min_replicas``..``max_replicas``). Pure functions; the Admin API's
``Plan`` feeds them and applies the result when asked (``kvrelay plan --apply``).

Rules, one step at a time so a plan never overreacts to one window:

- prefill at a site: enough workers to compute the prompt tokens placed
  there at ``TARGET_UTILIZATION`` of their measured throughput; one more when
  TTFT (p90) of requests prefilled there misses the SLO or prompts are queued
  beyond what the SLO allows; one fewer when the pool would still be under
  half that utilisation and TTFT is under half its SLO.
- decode at a site: one more when TPOT (p90) misses the SLO, requests wait,
  or KV blocks are over ``KV_HIGH`` used; one fewer when TPOT is under half
  its SLO, nothing waits and KV use is under ``KV_LOW`` (never a site's last one).
- the cluster always keeps at least one decode worker."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrelay.runtime.roles import Role

TARGET_UTILIZATION = 0.7
KV_HIGH, KV_LOW = 0.85, 0.3


@dataclass(slots=True)
class PoolFigures:
    """What the router knows of one pool over the window."""

    site: str
    role: Role
    desired: int
    active: int
    min_replicas: int
    max_replicas: int
    tokens_per_s_placed: float = 0.0
    """Prefill: prompt tokens per second placed on this pool."""
    tokens_per_s_per_worker: float = 0.0
    """Prefill: measured prompt tokens per second of one worker."""
    queued_tokens: int = 0
    """Prefill: prompt tokens queued at the pool now."""
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    waiting: int = 0
    """Decode: requests waiting for a batch slot now."""
    kv_usage: float = 0.0
    """Decode: fraction of KV blocks in use (mean over the pool)."""
    requests: int = 0
    """Requests of the window that this pool served."""


@dataclass(slots=True)
class PoolPlan:
    site: str
    role: Role
    current: int
    recommended: int
    reasons: list[str] = field(default_factory=list)


def _bounded(n: int, f: PoolFigures, reasons: list[str]) -> int:
    if n > f.max_replicas:
        reasons.append(f"capped at max_replicas={f.max_replicas}")
        return f.max_replicas
    if n < f.min_replicas:
        return f.min_replicas
    return n


def plan_prefill(f: PoolFigures, slo_ttft_s: float) -> PoolPlan:
    reasons: list[str] = []
    cur = f.desired
    n = cur
    if f.tokens_per_s_per_worker > 0:
        util_need = math.ceil(f.tokens_per_s_placed / (f.tokens_per_s_per_worker * TARGET_UTILIZATION))
        queue_s = f.queued_tokens / (f.tokens_per_s_per_worker * max(1, f.active))
    else:
        util_need, queue_s = 0, 0.0
    if f.ttft_p90_s is not None and f.ttft_p90_s > slo_ttft_s:
        n = max(util_need, cur + 1)
        reasons.append(f"TTFT p90 {f.ttft_p90_s:.2f} s > SLO {slo_ttft_s:g} s")
    elif queue_s > slo_ttft_s:
        n = max(util_need, cur + 1)
        reasons.append(f"{f.queued_tokens} prompt tokens queued: {queue_s:.1f} s of work > SLO {slo_ttft_s:g} s")
    elif util_need > cur:
        n = cur + 1
        reasons.append(f"{f.tokens_per_s_placed:.0f} prompt tok/s placed needs {util_need} workers at "
                       f"{TARGET_UTILIZATION:.0%} of {f.tokens_per_s_per_worker:.0f} tok/s each")
    elif cur > 0 and (f.ttft_p90_s is None or f.ttft_p90_s < slo_ttft_s / 2) and \
            f.tokens_per_s_placed < (cur - 1) * f.tokens_per_s_per_worker * TARGET_UTILIZATION / 2:
        n = cur - 1
        reasons.append(f"{f.tokens_per_s_placed:.0f} prompt tok/s placed would keep {cur - 1} workers under "
                       f"{TARGET_UTILIZATION / 2:.0%} busy")
    else:
        reasons.append("within targets")
    return PoolPlan(f.site, f.role, cur, _bounded(n, f, reasons), reasons)


def plan_decode(f: PoolFigures, slo_tpot_s: float) -> PoolPlan:
    reasons: list[str] = []
    cur = f.desired
    n = cur
    if f.tpot_p90_s is not None and f.tpot_p90_s > slo_tpot_s:
        n = cur + 1
        reasons.append(f"TPOT p90 {f.tpot_p90_s * 1e3:.0f} ms > SLO {slo_tpot_s * 1e3:.0f} ms")
    elif f.waiting > 0:
        n = cur + 1
        reasons.append(f"{f.waiting} requests waiting for a batch slot")
    elif f.kv_usage > KV_HIGH:
        n = cur + 1
        reasons.append(f"KV blocks {f.kv_usage:.0%} used > {KV_HIGH:.0%}")
    elif cur > 1 and f.kv_usage < KV_LOW and (f.tpot_p90_s is None or f.tpot_p90_s < slo_tpot_s / 2):
        n = cur - 1
        reasons.append(f"TPOT well under SLO and KV blocks {f.kv_usage:.0%} used < {KV_LOW:.0%}")
    else:
        reasons.append("within targets")
    return PoolPlan(f.site, f.role, cur, _bounded(n, f, reasons), reasons)


def plan(pools: list[PoolFigures], slo_ttft_s: float, slo_tpot_s: float) -> list[PoolPlan]:
    """One recommendation per pool; keeps at least one decode worker overall."""
    out = [plan_prefill(f, slo_ttft_s) if f.role == Role.PREFILL else plan_decode(f, slo_tpot_s) for f in pools]
    decode = [p for p in out if p.role == Role.DECODE]
    if decode and sum(p.recommended for p in decode) == 0:
        keep = max(decode, key=lambda p: p.current)
        keep.recommended = 1
        keep.reasons.append("the cluster keeps at least one decode worker")
    return out


@dataclass(slots=True)
class Served:
    """One finished request, as the planner counts it."""

    at: float
    prefill_site: str
    prefill_role: Role
    """PREFILL, or DECODE when the decode worker computed the prompt itself."""
    decode_site: str
    prompt_tokens: int
    ttft_s: float
    tpot_s: float | None


class RequestWindow:
    """Finished requests of the last ``window_s`` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.items: list[Served] = []

    def add(self, item: Served) -> None:
        self.items.append(item)
        self.trim(item.at)

    def trim(self, now: float) -> list[Served]:
        cut = now - self.window_s
        if self.items and self.items[0].at < cut:
            self.items = [s for s in self.items if s.at >= cut]
        return self.items


def p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]
