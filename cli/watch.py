"""`kvrelay status` as text: pools, workers, links, recent latency and the
/metrics addresses (:func:`render_status`, pure), and ``--watch``'s loop that
redraws it every few seconds (:func:`watch`)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import TextIO

from kvrelay.runtime.roles import Role
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import worker_pb2 as wpb

CLEAR = "\x1b[H\x1b[2J"
"""Cursor home and clear screen: starts each frame on a terminal."""
_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def human_bytes(n: float, suffix: str = "") -> str:
    """``n`` bytes in decimal units: ``512 B``, ``12.3 MB`` (``suffix``: e.g. ``/s``)."""
    value, unit = float(n), 0
    while abs(value) >= 1000 and unit < len(_UNITS) - 1:
        value, unit = value / 1000, unit + 1
    text = f"{value:.0f}" if unit == 0 else f"{value:.1f}"
    return f"{text} {_UNITS[unit]}{suffix}"


def table_lines(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` (the first: the header) as aligned lines, as cli.common.table prints them."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]


def pool_rows(pools) -> list[tuple[str, ...]]:
    """The pools table (header first)."""
    return [("SITE", "ROLE", "DESIRED", "ACTIVE", "DRAINING", "UNHEALTHY", "WORKERS")] + [
        (p.site, p.role, str(p.desired), str(p.active), str(p.draining), str(p.unhealthy), " ".join(p.workers))
        for p in pools]


def kv_used(load: wpb.WorkerLoad) -> str:
    """Share of a worker's KV blocks in use (1 - free/total), ``-`` before it reports any."""
    if load.total_blocks <= 0:
        return "-"
    return f"{100.0 * (1.0 - load.free_blocks / load.total_blocks):.0f}%"


def worker_rows(workers) -> list[tuple[str, ...]]:
    """The workers table: health, load, KV use, transport, addresses (header first)."""
    rows: list[tuple[str, ...]]
    rows = [("WORKER", "SITE", "ROLE", "HEALTH", "INFLIGHT", "RUNNING", "WAITING", "KV FREE/TOTAL", "KV USED",
             "CACHED", "PREFILL TOK/S", "TRANSPORT", "ADDRESS", "METRICS")]
    for w in workers:
        health = "draining" if w.draining else "ok" if w.healthy else "UNHEALTHY"
        rows.append((w.info.worker_id, w.info.site, Role.of(w.info.role), health, str(w.inflight),
                     str(w.load.running), str(w.load.waiting), f"{w.load.free_blocks}/{w.load.total_blocks}",
                     kv_used(w.load), str(w.cached_blocks), f"{w.load.prefill_tokens_per_s:.0f}",
                     w.info.transport, w.info.address, w.info.metrics_address or "-"))
    return rows


def measured_rate(lk: wpb.LinkStatus) -> str:
    """A link's measured rate: ``0.0487 (5)`` (Gbit/s, link-bound transfers), ``>=0.29`` (only a lower
    bound: its transfers never waited for it), ``-`` (no transfer lately)."""
    if lk.rate_samples:
        return f"{lk.measured_gbps:.3g} ({lk.rate_samples})"
    return f">={lk.measured_floor_gbps:.3g}" if lk.measured_floor_gbps else "-"


def link_rows(links) -> list[tuple[str, ...]]:
    """The links table: configured and measured figures, what placement uses, state and the KV rate
    of the last minute (header first)."""
    return [("LINK", "RTT MS", "MEASURED RTT", "GBPS", "MEASURED GBPS", "PLACEMENT USES", "TRANSPORT",
             "PROTECTION", "KV CODEC", "STATE", "KV RATE")] + [
        (lk.name, f"{lk.rtt_ms:g}", f"{lk.measured_rtt_ms:.3g}" if lk.measured_rtt_ms else "-", f"{lk.gbps:g}",
         measured_rate(lk), f"{lk.placement_gbps:.3g} ({lk.rate_source})" if lk.rate_source else "-",
         lk.transport, lk.protection, lk.kv_codec or "none",
         "up" if lk.up else f"DOWN ({lk.down_reason})", human_bytes(lk.kv_bytes_per_s, "/s")) for lk in links]


def latency_line(lat: wpb.LatencySummary) -> str:
    """``last 60 s: 14 requests, TTFT p50 120 ms p90 340 ms, ITL p50 41 ms p90 60 ms``."""
    if lat.window_s <= 0:
        return "latency: not reported by this router"
    if lat.requests <= 0:
        return f"no requests finished in the last {lat.window_s:g} s"
    noun = "request" if lat.requests == 1 else "requests"
    return (f"last {lat.window_s:g} s: {lat.requests} {noun}, TTFT p50 {lat.ttft_p50_ms:.0f} ms "
            f"p90 {lat.ttft_p90_ms:.0f} ms, ITL p50 {lat.itl_p50_ms:.0f} ms p90 {lat.itl_p90_ms:.0f} ms")


def render_status(workers_resp: wpb.ListWorkersResponse, pools_resp: apb.ListPoolsResponse | str) -> str:
    """The whole status as text; ``pools_resp`` a string: why the pools could not be read."""
    if isinstance(pools_resp, str):
        lines = [f"(pools: {pools_resp})"]
    else:
        lines = table_lines(pool_rows(pools_resp.pools))
    lines += ["", *table_lines(worker_rows(workers_resp.workers)), "",
              f"placement policy: {workers_resp.policy}", latency_line(workers_resp.latency), "",
              *table_lines(link_rows(workers_resp.links)), "",
              f"router metrics: {workers_resp.router_metrics_address or 'off'}",
              f"router {workers_resp.storage or 'disk: not reported'}", *router_lines(workers_resp)]
    return "\n".join(lines) + "\n"


def router_lines(resp: wpb.ListWorkersResponse) -> list[str]:
    """With several routers: who they are, which one answered, and the shared store's state."""
    if not resp.coordination:
        return []
    rows: list[tuple[str, ...]] = [("ROUTER", "SITE", "JURISDICTION", "GRPC", "INTERNAL")]
    rows += [(r.name + (" (this one)" if r.name == resp.router_name else ""), r.site, r.jurisdiction, r.address,
              r.internal_address) for r in resp.routers]
    return ["", *table_lines(rows), f"shared state: {resp.coordination}"]


def frame(body: str, now: float, interval_s: float, tty: bool, first: bool) -> str:
    """One frame of ``--watch``: on a terminal the screen is cleared first;
    elsewhere (a pipe, a file) frames follow each other, a blank line and a
    timestamp header between them."""
    stamp = datetime.datetime.fromtimestamp(now).strftime("%Y-%m-%d %H:%M:%S")
    if tty:
        return f"{CLEAR}kvrelay status  {stamp}  (every {interval_s:g} s; Ctrl-C to stop)\n\n{body}"
    return ("" if first else "\n") + f"== kvrelay status {stamp} ==\n{body}"


def watch(render: Callable[[], str], out: TextIO, interval_s: float, count: int | None = None,
          sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time) -> int:
    """Writes a frame of ``render()`` every ``interval_s`` (``count`` frames,
    None: until Ctrl-C, which ends it with exit code 0)."""
    tty = out.isatty()
    n = 0
    try:
        while count is None or n < count:
            if n:
                sleep(interval_s)
            out.write(frame(render(), clock(), interval_s, tty, first=n == 0))
            out.flush()
            n += 1
    except KeyboardInterrupt:
        out.write("\n")
    return 0
