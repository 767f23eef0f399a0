"""Serving metrics of a replay, with the field's definitions (vLLM's serving
benchmark, DistServe):

- TTFT: first token received - request sent;
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with >= 2 tokens;
- ITL: every gap between consecutive token arrivals (a message carrying k
  tokens contributes k gaps of 1/k of its gap each);
- E2E: last token received - request sent;
- goodput: requests per second that met every SLO given; SLO attainment:
  their share of all requests (failed ones count as misses).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    index: int
    scheduled_s: float
    """When the trace says it arrives (after the speed-up), from the replay's start."""
    sent_s: float
    input_tokens: int
    max_tokens: int
    token_times: list[float] = field(default_factory=list)
    """Arrival time of every token (from the replay's start)."""
    end_s: float | None = None
    error: str | None = None
    """gRPC status and message when the request failed."""
    placement: dict = field(default_factory=dict)
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    """What the request generated (compared between runs by the chaos replay)."""
    client_retries: int = 0
    """Times the client sent it again after UNAVAILABLE (a router restart)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_s if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.end_s - self.sent_s if self.ok and self.end_s is not None else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        e2e, ttft = self.e2e, self.ttft
        if e2e is None or ttft is None or n < 2:  # e2e: None unless ok
            return None
        return (e2e - ttft) / (n - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def distribution(xs: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (and count) of ``xs`` in the same unit."""
    if not xs:
        return {"count": 0}
    s = sorted(xs)

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        k = (len(s) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"count": len(s), "mean": statistics.fmean(s), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def summarize(records: Sequence[RequestRecord], slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None) -> dict:
    ok = [r for r in records if r.ok]
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.end_s for r in ok if r.end_s is not None), default=start)
    duration = max(end - start, 1e-9)
    out_tokens = sum(len(r.token_times) for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)

    def meets(r: RequestRecord) -> bool:
        if not r.ok:
            return False
        ttft = r.ttft
        if slo_ttft_s is not None and (ttft is None or ttft > slo_ttft_s):  # no token: no TTFT met
            return False
        return not (slo_tpot_s is not None and r.tpot is not None and r.tpot > slo_tpot_s)

    good = sum(1 for r in records if meets(r))
    failures: dict[str, int] = {}
    for r in records:
        if not r.ok:
            failures[r.error or "unfinished"] = failures.get(r.error or "unfinished", 0) + 1
    ms = 1e3
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "failures": failures, "duration_s": duration,
        "ttft_ms": distribution([r.ttft * ms for r in ok if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot * ms for r in ok if r.tpot is not None]),
        "itl_ms": distribution([g * ms for r in ok for g in r.itls()]),
        "e2e_ms": distribution([r.e2e * ms for r in ok if r.e2e is not None]),
        "request_throughput_rps": len(ok) / duration,
        "output_token_throughput_tps": out_tokens / duration,
        "total_token_throughput_tps": (in_tokens + out_tokens) / duration,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "goodput_rps": good / duration,
        "slo_attainment": good / max(1, len(records)),
        "prefix_cached_prompt_fraction": sum(r.cached_tokens for r in ok) / max(1, in_tokens),
    }


def per_link(records: Sequence[RequestRecord]) -> dict[str, dict]:
    """KV bytes moved and transfer time per link ("colocated" when none moved)."""
    links: dict[str, dict] = {}
    for r in records:
        if not r.ok:
            continue
        p = r.placement
        name = p.get("link") or "colocated"
        row = links.setdefault(name, {"requests": 0, "kv_bytes": 0, "transfer_ms": 0.0})
        row["requests"] += 1
        row["kv_bytes"] += p.get("kv_bytes", 0)
        row["transfer_ms"] += p.get("kv_transfer_ms", 0.0)
    return links


def per_site(records: Sequence[RequestRecord]) -> dict[str, dict]:
    """Requests prefilled and decoded per site, and KV bytes sent from it."""
    sites: dict[str, dict] = {}
    for r in records:
        if not r.ok:
            continue
        p = r.placement
        for key, site in (("prefilled", p.get("prefill_site")), ("decoded", p.get("decode_site"))):
            if site:
                row = sites.setdefault(site, {"prefilled": 0, "decoded": 0, "kv_bytes_sent": 0})
                row[key] += 1
        if p.get("prefill_site") and not p.get("colocated"):
            sites[p["prefill_site"]]["kv_bytes_sent"] += p.get("kv_bytes", 0)
    return sites
