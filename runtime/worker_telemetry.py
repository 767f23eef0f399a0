"""A worker's traces and metrics: its tracer (runtime/tracing.py), its
Prometheus registry with the engine's gauges and, on a decode worker, the
KV transfers it received (runtime/metrics.py), and its /metrics endpoint,
advertised to the router when it registers.

Worker spans (children of the router's ``kvrelay.attempt``, whose context
comes in the gRPC metadata): ``kvrelay.prefill`` > ``kvrelay.prefill.queue``,
``kvrelay.prefill.chunk`` (one per engine step that computed part of the
prompt), ``kvrelay.kv.send`` (an event per layer sent); ``kvrelay.decode`` >
``kvrelay.decode.reserve``, ``kvrelay.kv.receive`` (linked to the sender's
``kvrelay.kv.send``), ``kvrelay.decode.generate`` (events ``first_token``
and ``finish``)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry

from kvrelay.engine.interface import WorkerEngine
from kvrelay.engine.llm_engine import StepUsage
from kvrelay.runtime.config import TelemetrySection
from kvrelay.runtime.metrics import (
    CertificateCollector,
    EngineCollector,
    EngineState,
    MetricsServer,
    TransferMetrics,
    serve_metrics,
)
from kvrelay.runtime.roles import Role
from kvrelay.runtime.tls import TLSMaterial
from kvrelay.runtime.tracing import NO_TRACING, Tracing, process_name, within

log = logging.getLogger(__name__)


def engine_state(engine: WorkerEngine) -> EngineState:
    """The engine's gauges now (read from any thread: plain counters)."""
    st = engine.stats()
    used = 1.0 - st.num_free_blocks / st.num_blocks if st.num_blocks else 0.0
    hit = st.prefix_hit_blocks / st.prefix_query_blocks if st.prefix_query_blocks else 0.0
    return EngineState(used, hit, st.num_running, st.num_waiting, st.prefill_tokens_per_s)


@dataclass(slots=True)
class _Prompt:
    """A prompt being prefilled: its span and when it was queued."""

    span: Span
    queued_ns: int
    started: bool = False


class ChunkSpans:
    """Spans of each prompt's queue time and prefill chunks, made from the engine's
    step reports (``LLMEngine.step_hook``, on the engine thread)."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self._prompts: dict[str, _Prompt] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, span: Span, queued_ns: int) -> None:
        if span.is_recording():
            with self._lock:
                self._prompts[request_id] = _Prompt(span, queued_ns)

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._prompts.pop(request_id, None)

    def on_step(self, step: StepUsage) -> None:
        """Runs on the engine thread, inside its step: it never raises (a failure is logged)."""
        if not self._prompts:
            return
        try:
            self._spans(step)
        except Exception:  # telemetry must not stop the engine
            log.exception("prefill chunk spans failed")

    def _spans(self, step: StepUsage) -> None:
        start = step.end_unix_ns - step.ns
        for rid, (_, n) in zip(step.request_ids, step.tokens):
            with self._lock:
                p = self._prompts.get(rid)
            if p is None:
                continue
            if not p.started:
                p.started = True
                self.tracing.start("kvrelay.prefill.queue", within(p.span), start_ns=p.queued_ns).end(start)
            self.tracing.start("kvrelay.prefill.chunk", within(p.span), attributes={"kvrelay.tokens": n},
                               start_ns=start).end(step.end_unix_ns)


class WorkerTelemetry:
    """One worker's tracer, metrics registry and /metrics server."""

    def __init__(self, section: TelemetrySection, role: Role, worker_id: str, site: str, host: str | None = None,
                 tracing: Tracing | None = None) -> None:
        """``host``: where to serve /metrics (None: ``section.metrics_host``); ``tracing``:
        an existing tracer (None: one made from ``section``)."""
        self.section, self.role, self.worker_id, self.site = section, role, worker_id, site
        self.tracing = tracing or Tracing(section, f"kvrelay-{role}", process_name(worker_id),
                                          {"kvrelay.site": site, "kvrelay.worker": worker_id,
                                           "kvrelay.role": str(role)})
        self.registry = CollectorRegistry()
        self.transfers = TransferMetrics(self.registry) if role is Role.DECODE else None
        self.server: MetricsServer | None = None
        self.host = host or section.metrics_host

    def attributes(self) -> dict[str, str]:
        """What every span of this worker carries."""
        return {"kvrelay.site": self.site, "kvrelay.worker": self.worker_id}

    def serve(self, engine: WorkerEngine, advertise: str, tls: TLSMaterial | None = None) -> str:
        """Registers the engine's gauges (and ``tls``'s certificate expiry) and starts /metrics; returns
        the address to advertise ("" when off; ``advertise`` replaces a wildcard bind address)."""
        labels = {"worker": self.worker_id, "site": self.site, "role": str(self.role)}
        self.registry.register(EngineCollector(lambda: engine_state(engine), labels))
        if tls is not None:
            self.registry.register(CertificateCollector(tls, labels))
        self.server = serve_metrics(self.registry, self.host, self.section.worker_metrics_port)
        return self.server.advertised(advertise) if self.server is not None else ""

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.tracing.shutdown()


DISABLED = WorkerTelemetry(TelemetrySection(worker_metrics_port=None), Role.DECODE, "", "", tracing=NO_TRACING)
"""No traces, no /metrics (tests that build a service without a process around it)."""
