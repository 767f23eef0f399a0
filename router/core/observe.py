"""What the router tells operators about requests: one trace per request
(spans ``kvrelay.request`` > ``kvrelay.tokenize``, ``kvrelay.admission``,
``kvrelay.placement``, ``kvrelay.attempt`` per attempt; the workers' spans
are children of the attempt), the request metrics (runtime/metrics.py), and
the last minute's latency and KV rates per link for ``kvrelay status``.

:class:`RouterTelemetry` is the router's; :class:`RequestObservation`
follows one request from its arrival to its last message. Retries and
migrations are counted in the usage database too, so their counters
survive a router restart."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvrelay.router.core.errors import RouterError
from kvrelay.router.core.requests import Caller, Priority, Request
from kvrelay.router.placement.link_estimate import LinkState
from kvrelay.runtime.metrics import Mode, RouterMetrics, TokenKind
from kvrelay.runtime.roles import Role
from kvrelay.runtime.tracing import NO_TRACING, Tracing, link_to, trace_id_of, within
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

WINDOW_S = 60.0
"""What ``kvrelay status`` calls recent."""
WINDOW_MAX = 100_000
"""Most samples a window keeps (the newest): bounds the router's memory at any rate."""
RETRIES, MIGRATIONS = "retries", "migrations"
"""The durable counters' names in the usage database."""
TARGETS_REFRESH_S = 2.0
"""How often the router looks whether its Prometheus targets file needs rewriting."""
FINISH_REASONS = {ipb.FINISH_REASON_STOP: "stop", ipb.FINISH_REASON_LENGTH: "length"}


class RecentWindow:
    """Values of the last ``window_s`` seconds, for quantiles."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._items: deque[tuple[float, float]] = deque(maxlen=WINDOW_MAX)

    def add(self, value: float, n: int = 1) -> None:
        """``n`` samples of ``value``."""
        now = self.clock()
        self._items.extend((now, value) for _ in range(min(n, WINDOW_MAX)))
        self._trim()

    def _trim(self) -> None:
        cutoff = self.clock() - self.window_s
        while self._items and self._items[0][0] < cutoff:
            self._items.popleft()

    def values(self) -> list[float]:
        self._trim()
        return [v for _, v in self._items]

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (nearest rank) of the window's values; 0 when empty."""
        vals = sorted(self.values())
        if not vals:
            return 0.0
        return vals[min(len(vals) - 1, max(0, round(q * (len(vals) - 1))))]


class LinkRates:
    """KV bytes per link moved by requests that finished in the last ``window_s``."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._items: deque[tuple[float, str, int]] = deque(maxlen=WINDOW_MAX)

    def add(self, link: str, nbytes: int) -> None:
        if link and nbytes:
            self._items.append((self.clock(), link, nbytes))
            self._trim()

    def _trim(self) -> None:
        cutoff = self.clock() - self.window_s
        while self._items and self._items[0][0] < cutoff:
            self._items.popleft()

    def per_s(self) -> dict[str, float]:
        self._trim()
        out: dict[str, float] = {}
        for _, link, n in self._items:
            out[link] = out.get(link, 0.0) + n / self.window_s
        return out


class LinkCollector(Collector):
    """``kvrelay_link_up{link}`` (links between sites) and ``kvrelay_link_rate_gbps{link,source}`` (those and
    the local link), read from the registry at each scrape."""

    def __init__(self, links: Callable[[], list[LinkState]]) -> None:
        self.links = links

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("kvrelay_link_up", "1 while the link's probes succeed", labels=["link"])
        rate = GaugeMetricFamily("kvrelay_link_rate_gbps", "The rate placement prices the link's KV at (Gbit/s): "
                                 "measured from its transfers or configured", labels=["link", "source"])
        for lk in self.links():
            if lk.probed:
                up.add_metric([lk.name], 1.0 if lk.up else 0.0)
            rate.add_metric([lk.name, lk.source], lk.gbps)
        yield up
        yield rate


def outcome_of(error: BaseException | None) -> str:
    """``kvrelay_requests_total{outcome}``: ok, the error kind the caller was told,
    cancelled (the caller left) or internal (a bug)."""
    if error is None:
        return "ok"
    if isinstance(error, RouterError):
        return error.kind.value
    return "cancelled" if isinstance(error, (asyncio.CancelledError, GeneratorExit)) else "internal"


class RouterTelemetry:
    """The router's tracer, metrics and recent-latency windows."""

    def __init__(self, tracing: Tracing = NO_TRACING, registry: CollectorRegistry | None = None,
                 durable=None, links: Callable[[], list[LinkState]] | None = None) -> None:
        """``durable``: where retries and migrations are counted across restarts
        (router/cluster/usage.py ``UsageLedger``: ``counters()``, ``add_counter``); ``links``:
        every link between sites, for ``kvrelay_link_up`` and ``kvrelay_link_rate_gbps``."""
        self.tracing = tracing
        self.registry = registry or CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        if links is not None:
            self.registry.register(LinkCollector(links))
        self.durable = durable
        if durable is not None:
            counts = durable.counters()
            self.metrics.retries.inc(counts.get(RETRIES, 0))
            self.metrics.migrations.inc(counts.get(MIGRATIONS, 0))
        self.ttft = RecentWindow()
        self.itl = RecentWindow()
        self.link_rates = LinkRates()

    def observe(self, req: Request, caller: Caller, model: str) -> RequestObservation:
        return RequestObservation(self, req, caller, model)

    def refused(self, caller: Caller, error: BaseException) -> None:
        """A request that ended before it was admitted (quota, validation, or its caller left)."""
        try:
            self.metrics.requests.labels(caller.tenant, outcome_of(error)).inc()
        except Exception:
            log.exception("telemetry: refused failed")

    def count(self, name: str) -> None:
        """One retry or migration, in the metric and (on a thread: the event loop
        never waits on the disk) the usage database."""
        (self.metrics.retries if name == RETRIES else self.metrics.migrations).inc()
        if self.durable is not None:
            try:
                asyncio.get_running_loop().run_in_executor(None, self.durable.add_counter, name, 1)
            except RuntimeError:  # no event loop (tools, tests)
                self.durable.add_counter(name, 1)

    def latency(self) -> wpb.LatencySummary:
        """The last minute's TTFT and inter-token latency, for ``kvrelay status``."""
        n = len(self.ttft.values())
        return wpb.LatencySummary(window_s=WINDOW_S, requests=n, ttft_p50_ms=self.ttft.quantile(0.5) * 1e3,
                                  ttft_p90_ms=self.ttft.quantile(0.9) * 1e3, itl_p50_ms=self.itl.quantile(0.5) * 1e3,
                                  itl_p90_ms=self.itl.quantile(0.9) * 1e3)


def _never_raises(default=None):
    """Telemetry must not fail a request: an exception in the method is logged and ``default`` returned."""
    def wrap(method):
        @functools.wraps(method)
        def safe(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception:
                log.exception("telemetry: %s failed", method.__name__)
                return default
        return safe
    return wrap


class RequestObservation:
    """One request's spans and measurements, from its arrival to its last message.
    No method raises (see ``_never_raises``)."""

    def __init__(self, tel: RouterTelemetry, req: Request, caller: Caller, model: str) -> None:
        self.tel, self.caller = tel, caller
        self.t0 = req.arrived or time.perf_counter()
        wall0 = time.time_ns() - int((time.perf_counter() - self.t0) * 1e9)
        # a trace of the router's own: its id is random here, so the sampler's ratio holds whatever a client
        # sends, and no tenant can add spans to a trace id it learned; the client's span is a link
        self.root = tel.tracing.start("kvrelay.request", None, SpanKind.SERVER, {
            "gen_ai.operation.name": "chat" if req.chat else "text_completion", "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": req.work.max_tokens,
            "gen_ai.usage.input_tokens": len(req.work.prompt_token_ids),
            "kvrelay.tenant": caller.tenant, "kvrelay.request_id": req.client_id, "kvrelay.api": caller.api,
            "kvrelay.priority": "batch" if caller.priority is Priority.BATCH else "interactive",
            "kvrelay.jurisdictions": sorted(req.allowed_jurisdictions or ())}, start_ns=wall0,
            links=link_to(caller.traceparent))
        if req.tokenized_s:
            tel.tracing.start("kvrelay.tokenize", within(self.root), start_ns=wall0).end(
                wall0 + int(req.tokenized_s * 1e9))
        self.t_admitted = self.t0 + req.tokenized_s
        """When it was admitted (tokenized): its queue time starts."""
        self.admission: Span | None = None
        self.attempt: Span | None = None
        self.placed_once = False
        self.decode_site = ""
        self.t_last: float | None = None
        self.n_out = 0

    @property
    def trace_id(self) -> str:
        return trace_id_of(self.root)

    @_never_raises()
    def waiting(self) -> None:
        """The request found no room: its admission wait starts (once)."""
        if self.admission is None:
            self.admission = self.tel.tracing.start("kvrelay.admission", within(self.root))

    @_never_raises(INVALID_SPAN)
    def placed(self, pl, link: str, placed_ns: tuple[int, int]) -> Span:
        """An attempt on placement ``pl`` (router/placement/place.py) begins; returns its span
        (the workers' spans are its children). ``placed_ns``: when ``place`` ran (unix ns)."""
        if self.admission is not None:
            self.admission.end()
            self.admission = None
        self._end_attempt("the decode worker had no room; placed again")  # an attempt refused before it began
        mode = Mode.COLOCATED if pl.prefill is None else Mode.DISAGGREGATED
        if not self.placed_once:
            self.placed_once = True
            self.tel.metrics.queue.labels(self.caller.tenant).observe(time.perf_counter() - self.t_admitted)
        self.tel.metrics.placements.labels(pl.policy, mode.value).inc()
        self.decode_site = pl.decode.site
        prefill = pl.prefill or pl.decode
        attrs = {"kvrelay.placement.policy": pl.policy, "kvrelay.placement.mode": mode.value,
                 "kvrelay.placement.estimated_ttft_ms": pl.est_ttft_s * 1e3,
                 "kvrelay.prefill.worker": prefill.worker_id, "kvrelay.prefill.site": prefill.site,
                 "kvrelay.decode.worker": pl.decode.worker_id, "kvrelay.decode.site": pl.decode.site,
                 "kvrelay.link": link, "kvrelay.placement.prefill_cached_blocks": pl.cached_blocks_prefill,
                 "kvrelay.placement.decode_cached_blocks": pl.cached_blocks_decode}
        tr = self.tel.tracing
        tr.start("kvrelay.placement", within(self.root), attributes=attrs, start_ns=placed_ns[0]).end(placed_ns[1])
        self.attempt = tr.start("kvrelay.attempt", within(self.root), attributes=attrs)
        return self.attempt

    @_never_raises()
    def attempt_failed(self, stage: Role, worker_id: str, why: str) -> None:
        """The attempt failed on a worker; the next one retries (prefill) or migrates (decode)."""
        name = RETRIES if stage is Role.PREFILL else MIGRATIONS
        self.tel.count(name)
        self._end_attempt(why)
        self.root.add_event(f"kvrelay.{name[:-1]}", {"kvrelay.worker": worker_id, "kvrelay.reason": why[:300]})

    def _end_attempt(self, error: str | None) -> None:
        if self.attempt is not None:
            if error is not None:
                self.attempt.set_status(Status(StatusCode.ERROR, error[:300]))
            self.attempt.end()
            self.attempt = None

    @_never_raises()
    def message(self, out: ipb.GenerateResponse) -> None:
        """A message on its way to the client: TTFT at the first token, then each
        inter-token gap; the last one gets the trace id in its placement."""
        if out.HasField("finish"):
            self._finished(out.finish)
        n = len(out.token_ids)
        if not n:
            return
        now = time.perf_counter()
        labels = (self.caller.tenant, self.decode_site)
        if self.t_last is None:
            ttft = now - self.t0
            self.tel.metrics.ttft.labels(*labels).observe(ttft)
            self.tel.ttft.add(ttft)
            self.root.add_event("kvrelay.first_token")
            n -= 1
        elif n:
            gap = (now - self.t_last) / n
            itl = self.tel.metrics.itl.labels(*labels)
            for _ in range(n):
                itl.observe(gap)
            self.tel.itl.add(gap, n)
        self.t_last = now
        self.n_out += len(out.token_ids)

    @_never_raises()
    def finish(self, error: BaseException | None) -> None:
        """The request's end: its outcome and latency; every span ends."""
        m, tenant = self.tel.metrics, self.caller.tenant
        outcome = outcome_of(error)
        m.requests.labels(tenant, outcome).inc()
        m.e2e.labels(tenant, self.decode_site).observe(time.perf_counter() - self.t0)
        self._end_attempt(None if error is None else str(error))
        if self.admission is not None:
            self.admission.end()
        if error is not None:
            self.root.set_status(Status(StatusCode.ERROR, str(error)[:300]))
        self.root.set_attribute("gen_ai.usage.output_tokens", self.n_out)
        self.root.end()

    def _finished(self, f: ipb.Finish) -> None:
        m, tenant, u, p = self.tel.metrics, self.caller.tenant, f.usage, f.placement
        cached = min(u.cached_prompt_tokens, u.prompt_tokens)
        m.tokens.labels(tenant, TokenKind.PROMPT.value).inc(u.prompt_tokens - cached)
        m.tokens.labels(tenant, TokenKind.CACHED.value).inc(cached)
        m.tokens.labels(tenant, TokenKind.COMPLETION.value).inc(u.completion_tokens)
        self.tel.link_rates.add(p.link, p.kv_bytes)
        p.trace_id = self.trace_id
        reason = FINISH_REASONS.get(f.reason)
        if reason is not None:
            self.root.set_attribute("gen_ai.response.finish_reasons", [reason])
        self.root.set_attributes({"kvrelay.kv.bytes": p.kv_bytes, "kvrelay.retries": p.retries,
                                  "kvrelay.migrations": p.migrations, "kvrelay.link": p.link,
                                  "kvrelay.transport": p.transport})


def prometheus_targets(address: str, site: str, workers: Iterable[wpb.WorkerInfo]) -> list[dict]:
    """Every process's /metrics as Prometheus ``file_sd`` entries: the router's own (``address``,
    "" when it serves none; at ``site``) and those of the ``workers`` that registered one."""
    out = []
    if address:
        out.append({"targets": [address], "labels": {"role": "router", "site": site, "worker": "router"}})
    for info in sorted(workers, key=lambda w: w.worker_id):
        if info.metrics_address:
            out.append({"targets": [info.metrics_address], "labels": {
                "role": Role.of(info.role).value, "site": info.site, "worker": info.worker_id}})
    return out


def write_targets(path: Path, targets: list[dict]) -> None:
    """Replaces ``path`` with ``targets`` as JSON in one rename (Prometheus never reads half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(targets, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
