"""``kvrelay bench replay``: replays a request trace against a cluster
through the public gRPC API, at the trace's arrival times (scaled by a
speed-up), with its exact token counts and forced output lengths, while
sampling every worker's load; then writes report.json and report.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from kvrelay.benchmarks.metrics import RequestRecord, per_link, per_site, summarize
from kvrelay.benchmarks.plots import write_plots
from kvrelay.benchmarks.traces import ScaledRequest, TraceRequest, scale_lengths
from kvrelay.runtime.roles import Role
from kvrelay.runtime.rpc import Dialer
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc


@dataclass(slots=True)
class ReplayConfig:
    speedup: float = 1.0
    """Arrival times are divided by this."""
    request_timeout_s: float = 600.0
    """Deadline of each request."""
    sample_interval_s: float = 0.5
    """How often worker load is sampled."""
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    progress: bool = True
    retries: int = 0
    """Times a request is sent again after UNAVAILABLE (the router restarting,
    no worker registered yet), as a client library would; from scratch, and
    its latency still counts from the first send."""
    overload_retries: int = 5
    """Times a request refused as overloaded (RESOURCE_EXHAUSTED with a
    ``retry-after-ms`` hint) is sent again, each time after the advised wait,
    while its deadline leaves room for the wait; its latency still counts
    from the first send. One refused for good counts as shed."""
    warmup: int = 0
    """Requests sent one at a time before the replay (prompts as long as the
    trace's first ones, other tokens, 4 output tokens each) and left out of the
    report: the workers' first steps and KV connections are not part of the
    workload, and the trace's prompts are not cached by them."""


@dataclass(slots=True)
class ReplayRecord(RequestRecord):
    """A request's record, with what overload refusals cost it."""

    overload_retries: int = 0
    """Times it was sent again after an overload refusal (RESOURCE_EXHAUSTED, retry-after-ms)."""
    overload_wait_s: float = 0.0
    """Seconds it waited, as advised, before those resends."""
    trace_id: str = ""
    """Its OpenTelemetry trace (32 hex; "" when not sampled or traces are off), from
    its placement: ``kvrelay trace TRACE_ID`` shows it."""
    router_moves: int = 0
    """Times it moved to another router because its own went away (several routers) ..."""
    router_resumes: int = 0
    """... of which its stream had started: resumed after the tokens it had."""


@dataclass(slots=True)
class WorkerSamples:
    busy: int = 0
    samples: int = 0
    kv_usage: list[float] = field(default_factory=list)
    first: wpb.WorkerLoad | None = None
    last: wpb.WorkerLoad | None = None
    site: str = ""
    role: str = ""


def trace_slice(reqs: list[TraceRequest]) -> list[dict]:
    """The replayed slice of a trace as the report records it."""
    return [{"index": r.index, "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
             "output_tokens": r.output_tokens} for r in reqs]


def check_lengths(reqs: list[TraceRequest], scale: float, context_window: int,
                  out_scale: float | None = None) -> list[int]:
    """Indexes of requests that would not fit the model's context window
    after scaling; the caller reports them (they are never dropped silently)."""
    return [r.index for r, (i, o) in zip(reqs, scale_lengths(reqs, scale, out_scale)) if i + o > context_window]


RETRY_BACKOFF_S = (0.25, 2.0)
"""First and longest pause before a request is sent again after UNAVAILABLE."""
OVERLOAD_JITTER = 0.1
"""An advised wait is lengthened by up to this fraction (never shortened), so
requests refused together do not all come back at the same instant."""
SHED = grpc.StatusCode.RESOURCE_EXHAUSTED
"""The status of a request the cluster refused as overloaded."""


def retry_after_s(exc: grpc.aio.AioRpcError) -> float | None:
    """The wait the server advised (trailing metadata ``retry-after-ms``); None
    if it gave none, or not a number of milliseconds >= 0."""
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                ms = float(value)
            except (TypeError, ValueError):
                return None
            return ms / 1e3 if math.isfinite(ms) and ms >= 0 else None
    return None


def _left_s(rec: RequestRecord, t0: float, cfg: ReplayConfig) -> float:
    """What is left of the request's deadline (counted from its first send)."""
    return rec.sent_s + cfg.request_timeout_s - (time.perf_counter() - t0)


def _overload_wait(exc: grpc.aio.AioRpcError, rec: ReplayRecord, cfg: ReplayConfig, left: float) -> float | None:
    """How long to wait before sending again after an overload refusal; None:
    not one with a hint, retries spent, or the advised wait would not leave the deadline any room."""
    hint = retry_after_s(exc) if exc.code() == SHED else None
    if hint is None or rec.overload_retries >= cfg.overload_retries or hint >= left:
        return None
    jitter = hint * OVERLOAD_JITTER * random.random()
    return hint + jitter if hint + jitter < left else hint


def _retry_wait(exc: grpc.aio.AioRpcError, rec: ReplayRecord, cfg: ReplayConfig, left: float,
                backoff: float) -> tuple[float, bool] | None:
    """(seconds to wait, whether it is an overload retry) before sending again; None: give up."""
    wait = _overload_wait(exc, rec, cfg, left)
    if wait is not None:
        return wait, True
    if exc.code() == grpc.StatusCode.UNAVAILABLE and rec.client_retries < cfg.retries and left >= backoff:
        return backoff, False
    return None


async def _attempts(stubs: list, first: int, req: ipb.GenerateRequest, t0: float, cfg: ReplayConfig,
                    rec: ReplayRecord) -> bool:
    """Sends ``req`` (to ``stubs[first]``) until it succeeds (True) or a retry rule gives up (False, ``rec.error``
    set). With several routers, one that goes away (UNAVAILABLE) hands the request to the next at once: resumed
    after the tokens already received (``resume_token_ids``, with the last one's ``resume_ticket``), or sent
    afresh if none came."""
    backoff, at, hops = RETRY_BACKOFF_S[0], first, 0
    while True:
        if not req.resume_token_ids:
            rec.token_times, rec.token_ids = [], []
            req.ClearField("resume_ticket")  # afresh: no stream to resume
        rec.error = None
        try:
            await _stream(stubs[at % len(stubs)], req, t0, cfg, rec)
            return True
        except grpc.aio.AioRpcError as exc:
            rec.error = f"{exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.UNAVAILABLE and len(stubs) > 1 and hops < 2 * len(stubs):
                at, hops = at + 1, hops + 1  # the next router, at once
                rec.router_moves += 1
                if rec.token_ids:
                    rec.router_resumes += 1
                    del req.resume_token_ids[:]
                    req.resume_token_ids.extend(rec.token_ids)
                continue
            retry = _retry_wait(exc, rec, cfg, _left_s(rec, t0, cfg), backoff)
        if retry is None:
            return False
        wait, overload = retry
        await asyncio.sleep(wait)  # < what is left of the deadline
        if overload:
            rec.overload_retries += 1
            rec.overload_wait_s += wait
        else:
            backoff = min(RETRY_BACKOFF_S[1], backoff * 2)
            rec.client_retries += 1


async def _one(stubs: list, sr: ScaledRequest, t0: float, cfg: ReplayConfig, rec: ReplayRecord) -> None:
    delay = t0 + rec.scheduled_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=sr.prompt), max_tokens=sr.max_tokens, ignore_eos=True,
                              request_id=f"replay-{sr.trace.index}")
    rec.sent_s = time.perf_counter() - t0
    if not await _attempts(stubs, sr.trace.index, req, t0, cfg, rec):
        return
    rec.end_s = time.perf_counter() - t0
    # a message carrying k tokens: spread them over the gap since the previous one
    _spread(rec.token_times)
    if len(rec.token_times) != sr.max_tokens:
        rec.error = f"got {len(rec.token_times)} tokens, the trace forces {sr.max_tokens}"


async def _stream(stub, req: ipb.GenerateRequest, t0: float, cfg: ReplayConfig, rec: ReplayRecord) -> None:
    """One attempt at a request, recording its tokens, final placement and trace id."""
    async for msg in stub.Generate(req, timeout=max(0.1, _left_s(rec, t0, cfg))):
        now = time.perf_counter() - t0
        rec.token_times += [now] * len(msg.token_ids)
        rec.token_ids.extend(msg.token_ids)
        if msg.resume_ticket:
            req.resume_ticket = msg.resume_ticket  # what another router asks of a resumption after these tokens
        if msg.HasField("finish"):
            p = msg.finish.placement
            rec.placement = {"prefill_site": p.prefill_site, "decode_site": p.decode_site,
                             "prefill_worker": p.prefill_worker, "decode_worker": p.decode_worker,
                             "colocated": p.colocated, "link": p.link, "transport": p.transport,
                             "kv_bytes": p.kv_bytes, "kv_codec": p.kv_codec, "kv_transfer_ms": p.kv_transfer_ms,
                             "prefill_ms": p.prefill_ms,
                             "estimated_ttft_ms": p.estimated_ttft_ms, "router_ttft_ms": p.ttft_ms,
                             "retries": p.retries, "migrations": p.migrations, "link_gbps": p.link_gbps,
                             "link_rate_source": p.link_rate_source, "link_measured_gbps": p.link_measured_gbps,
                             "link_bound": p.link_bound}
            rec.cached_tokens = msg.finish.usage.cached_prompt_tokens
            rec.trace_id = p.trace_id


def _spread(times: list[float]) -> None:
    i = 0
    while i < len(times):
        j = i
        while j + 1 < len(times) and times[j + 1] == times[i]:
            j += 1
        if j > i and i > 0:
            prev, last, k = times[i - 1], times[i], j - i + 1
            for n in range(k):
                times[i + n] = prev + (last - prev) * (n + 1) / k
        i = j + 1


async def _sample(reg, stop: asyncio.Event, interval: float, out: dict[str, WorkerSamples]) -> None:
    while True:
        try:
            resp = await reg.ListWorkers(wpb.ListWorkersRequest(), timeout=5)
            for w in resp.workers:
                s = out.setdefault(w.info.worker_id, WorkerSamples(site=w.info.site, role=Role.of(w.info.role)))
                s.samples += 1
                s.busy += int(w.inflight > 0 or w.load.running > 0 or w.load.waiting > 0)
                if w.load.total_blocks:
                    s.kv_usage.append(1 - w.load.free_blocks / w.load.total_blocks)
                s.first = s.first or w.load
                s.last = w.load
        except grpc.aio.AioRpcError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except TimeoutError:
            pass


async def _warm_up(stub, reqs: list[ScaledRequest], cfg: ReplayConfig) -> None:
    """Sends prompts as long as ``reqs``' (their tokens reversed, so nothing of the
    trace gets cached), 4 tokens each, one after the other; their outcome is not recorded."""
    for sr in reqs:
        req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=sr.prompt[::-1]), max_tokens=min(4, sr.max_tokens),
                                  ignore_eos=True, request_id=f"warmup-{sr.trace.index}")
        try:
            async for _ in stub.Generate(req, timeout=cfg.request_timeout_s):
                pass
        except grpc.aio.AioRpcError as exc:
            print(f"replay: warm-up request {sr.trace.index} failed: {exc.code().name}", file=sys.stderr)


async def replay(address: str, reqs: list[ScaledRequest], cfg: ReplayConfig, client: Dialer,
                 operator: Dialer) -> tuple[list[ReplayRecord], dict]:
    """Runs the replay; returns a record per request and per-worker samples.
    ``address``: the router's, or several comma-separated (requests go to each in turn, and move to the
    next when theirs goes away). ``client`` sends the requests (a tenant's credentials); ``operator``
    samples the workers' load (ListWorkers needs an operator) at the first router."""
    records = [ReplayRecord(sr.trace.index, sr.trace.arrival_s / cfg.speedup, 0.0, len(sr.prompt), sr.max_tokens)
               for sr in reqs]
    samples: dict[str, WorkerSamples] = {}
    # reconnect quickly to a router that restarted (the default backoff grows to minutes)
    opts = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000))
    addresses = [a for a in address.split(",") if a]
    channels = [client.aio(a, options=opts) for a in addresses]
    async with contextlib.AsyncExitStack() as stack, operator.aio(addresses[0], options=opts) as och:
        for ch in channels:
            await stack.enter_async_context(ch)
        stubs, reg = [igrpc.InferenceStub(ch) for ch in channels], wgrpc.RegistryStub(och)
        await _warm_up(stubs[0], reqs[:cfg.warmup], cfg)
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample(reg, stop, cfg.sample_interval_s, samples))
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(stubs, sr, t0, cfg, rec)) for sr, rec in zip(reqs, records)]
        for done, fut in enumerate(asyncio.as_completed(tasks), 1):
            await fut
            if cfg.progress:
                failed = sum(1 for r in records if r.error)
                bar = "#" * (30 * done // len(tasks))
                print(f"\rreplay [{bar:<30}] {done}/{len(tasks)} done, {failed} failed, "
                      f"{time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
        if cfg.progress:
            print(file=sys.stderr)
        stop.set()
        await sampler
    return records, samples


def worker_rows(samples: dict[str, WorkerSamples]) -> dict[str, dict]:
    """The report's per-worker rows from sampled loads."""
    workers = {}
    for wid, s in sorted(samples.items()):
        row = {"site": s.site, "role": s.role, "busy_fraction": s.busy / max(1, s.samples),
               "kv_usage_mean": sum(s.kv_usage) / len(s.kv_usage) if s.kv_usage else 0.0,
               "kv_usage_max": max(s.kv_usage, default=0.0)}
        if s.first is not None and s.last is not None:
            row["prefill_tokens"] = s.last.prefill_tokens_total - s.first.prefill_tokens_total
            row["decode_tokens"] = s.last.decode_tokens_total - s.first.decode_tokens_total
            hits = s.last.prefix_hit_blocks - s.first.prefix_hit_blocks
            queries = s.last.prefix_query_blocks - s.first.prefix_query_blocks
            row["prefix_hit_rate"] = hits / queries if queries else 0.0
        workers[wid] = row
    return workers


def build_report(records: Sequence[RequestRecord], samples: dict[str, WorkerSamples], cfg: ReplayConfig,
                 meta: dict) -> dict:
    return assemble_report(records, worker_rows(samples), cfg.slo_ttft_s, cfg.slo_tpot_s, meta)


def assemble_report(records: Sequence[RequestRecord], workers: dict[str, dict], slo_ttft_s: float | None,
                    slo_tpot_s: float | None, meta: dict) -> dict:
    """report.json's content (a live replay's and a simulation's alike): meta,
    summary, per link, per site, per worker, every request."""
    summary = summarize(records, slo_ttft_s, slo_tpot_s) | overload_summary(records)
    return {"meta": meta, "summary": summary,
            "per_link": per_link(records), "per_site": per_site(records), "per_worker": workers,
            "requests": [asdict(r) for r in records]}


def overload_summary(records: Sequence[RequestRecord]) -> dict:
    """The report's overload fields (stable names): ``retried_429``, resends
    after an overload refusal (gRPC RESOURCE_EXHAUSTED, HTTP 429);
    ``retried_429_requests``, requests that needed any; ``overload_wait_s``,
    seconds waited as advised; ``shed``, requests refused as overloaded for good; ``router_moves``,
    requests moved to another router because theirs went away, ``router_resumes`` those of them whose
    stream had started (several routers)."""
    retries = [getattr(r, "overload_retries", 0) for r in records]
    return {"retried_429": sum(retries), "retried_429_requests": sum(1 for n in retries if n),
            "overload_wait_s": sum(getattr(r, "overload_wait_s", 0.0) for r in records),
            "shed": sum(1 for r in records if (r.error or "").startswith(f"{SHED.name}:")),
            "router_moves": sum(getattr(r, "router_moves", 0) for r in records),
            "router_resumes": sum(getattr(r, "router_resumes", 0) for r in records)}


def _fmt(d: dict) -> str:
    if not d.get("count"):
        return "n/a | n/a | n/a | n/a"
    return " | ".join(f"{d[k]:.1f}" for k in ("mean", "p50", "p90", "p99"))


def _goodput_line(s: dict, slo: dict) -> str:
    objectives = [f"{name} <= {slo[key]} s" for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"))
                  if slo[key] is not None]
    if not objectives:
        return "- Goodput: no SLO given (--slo-ttft, --slo-tpot), so every completed request counts"
    return (f"- Goodput ({', '.join(objectives)}): {s['goodput_rps']:.2f} req/s; "
            f"SLO attainment {s['slo_attainment']:.1%}")


def _overload_lines(s: dict) -> list[str]:
    """The overload line of the report (none when nothing was refused as overloaded)."""
    if not (s.get("retried_429") or s.get("shed")):
        return []
    return [f"- Refused as overloaded: {s['retried_429']} resends after the advised wait "
            f"({s['retried_429_requests']} requests, {s['overload_wait_s']:.1f} s waited); {s['shed']} requests shed"]


def report_markdown(report: dict) -> str:
    m, s = report["meta"], report["summary"]
    what = "Simulation" if m.get("simulated") else "Replay"
    lines = [f"# {what} of {m['trace']} ({m['format']})", "",
             f"{s['requests']} requests (first {m['limit'] or 'all'} of the trace), speed-up {m['speedup']}x, "
             f"length scale {m['length_scale']}{' (scaled: ' + m['scale_reason'] + ')' if m['scale_reason'] else ''}, "
             f"policy {m.get('policy', '?')}, {m['started']}"
             f"{', over emulated WAN links (kvrelay cities)' if m.get('wan_emulation') else ''}.", "",
             f"Completed {s['completed']}, failed {s['failed']}, in {s['duration_s']:.1f} s.", "",
             "| metric (ms) | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        lines.append(f"| {name} | {_fmt(s[key])} |")
    slo = s["slo"]
    lines += ["", f"- Throughput: {s['request_throughput_rps']:.2f} req/s, {s['output_token_throughput_tps']:.1f} "
                  f"output tok/s, {s['total_token_throughput_tps']:.1f} total tok/s",
              _goodput_line(s, slo),
              f"- Prompt tokens served from prefix caches: {s['prefix_cached_prompt_fraction']:.1%}",
              *_overload_lines(s), ""]
    if s["failures"]:
        lines += ["Failures:", ""] + [f"- {n} x {why}" for why, n in s["failures"].items()] + [""]
    lines += ["| link | requests | KV MiB | transfer tail ms (sum) |", "|---|---|---|---|"]
    for name, row in report["per_link"].items():
        lines.append(f"| {name} | {row['requests']} | {row['kv_bytes'] / 2**20:.1f} | {row['transfer_ms']:.0f} |")
    lines += ["", "| worker | site | role | busy | KV usage mean / max | prefix hit rate |",
              "|---|---|---|---|---|---|"]
    for wid, row in report["per_worker"].items():
        lines.append(f"| {wid} | {row['site']} | {row['role']} | {row['busy_fraction']:.0%} | "
                     f"{row['kv_usage_mean']:.0%} / {row['kv_usage_max']:.0%} | {row.get('prefix_hit_rate', 0):.0%} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path, plots: bool = True) -> None:
    """report.json, report.md and (unless ``plots`` is False) the PNG plots in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    pngs = write_plots(report, out) if plots else []
    md = report_markdown(report) + "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    (out / "report.md").write_text(md)
