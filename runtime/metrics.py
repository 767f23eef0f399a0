"""The Prometheus metrics kvrelay exports, and the /metrics endpoint every
process serves (``prometheus_client``, one registry per process).

Names follow the field's usage (vLLM's ``vllm:time_to_first_token_seconds``
and the like, with the ``kvrelay_`` prefix). Every label takes values from a
bounded set: tenants, sites, links, policies and workers come from the
config, outcomes, kinds, modes, transports and failure reasons are closed
enums. No request id is ever a label.

The router exports the request metrics (:class:`RouterMetrics`); each worker
its engine's state (:class:`EngineCollector`) and, on a decode worker (the
side that knows a transfer landed), the KV transfers it received
(:class:`TransferMetrics`). Counters are per process and start from zero when
it starts, except ``kvrelay_retries_total`` and ``kvrelay_migrations_total``,
which the router keeps in its usage database (router/core/observe.py)."""

from __future__ import annotations

import enum
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvrelay.runtime.pki import cert_info, load_cert
from kvrelay.runtime.tls import TLSMaterial

disable_created_metrics()  # no ``_created`` series: process-wide, and kvrelay's processes want none
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
"""Seconds (TTFT, request latency, queue time), as vLLM's."""
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TokenKind(enum.StrEnum):
    PROMPT = "prompt"
    COMPLETION = "completion"
    CACHED = "cached"


class Mode(enum.StrEnum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


class FailureReason(enum.StrEnum):
    """``kvrelay_kv_transfer_failures_total{reason}``: why a transfer failed, in a closed set."""

    TIMEOUT = "timeout"
    """The KV did not arrive within the lease."""
    INTEGRITY = "integrity"
    """A frame failed authentication, a checksum or a layout check."""
    REFUSED = "refused"
    """The handshake or the peer's certificate was refused."""
    CONNECTION = "connection"
    """The connection to the peer failed or was lost."""
    CANCELLED = "cancelled"
    OTHER = "other"


_REASON_WORDS = ((FailureReason.TIMEOUT, ("timeout", "timed out", "lease", "deadline", "stall")),
                 (FailureReason.INTEGRITY, ("checksum", "authentic", "tag", "mac", "decrypt", "layout", "corrupt")),
                 (FailureReason.REFUSED, ("refused", "certificate", "handshake", "permission", "not allowed")),
                 (FailureReason.CONNECTION, ("connection", "reset", "closed", "unreachable", "eof", "broken")),
                 (FailureReason.CANCELLED, ("cancel",)))


def failure_reason(message: str) -> FailureReason:
    """The closed-set reason of a transfer failure's message."""
    low = message.lower()
    for reason, words in _REASON_WORDS:
        if any(w in low for w in words):
            return reason
    return FailureReason.OTHER


# -- the router's ---------------------------------------------------------------------------------------------------
class RouterMetrics:
    """The router's request metrics, in its own registry (``kvrelay_link_up`` is
    router/core/observe.py's collector, read from the registry at each scrape)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = Histogram("kvrelay_time_to_first_token_seconds", "Time from the request's arrival at the "
                              "router to its first token", ["tenant", "decode_site"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("kvrelay_inter_token_latency_seconds", "Time between consecutive tokens of a stream",
                             ["tenant", "decode_site"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvrelay_e2e_request_latency_seconds", "Time from arrival to the last message",
                             ["tenant", "decode_site"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kvrelay_queue_time_seconds", "Time a request waited at the router for a placement",
                               ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("kvrelay_requests", "Requests finished, by outcome: ok, or the error kind "
                                "the caller was told (router/core/errors.py ErrorKind)", ["tenant", "outcome"],
                                registry=r)
        self.tokens = Counter("kvrelay_tokens", "Tokens of finished requests: prompt (computed), cached "
                              "(prompt tokens a prefix cache held) and completion", ["tenant", "kind"], registry=r)
        self.placements = Counter("kvrelay_placements", "Attempts placed, by policy and mode", ["policy", "mode"],
                                  registry=r)
        self.retries = Counter("kvrelay_retries", "Prompts placed again after a prefill or transfer failure "
                               "(kept across router restarts)", registry=r)
        self.migrations = Counter("kvrelay_migrations", "Streams moved to another decode worker after it failed "
                                  "(kept across router restarts)", registry=r)


# -- a worker's ---------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class EngineState:
    """What a worker's engine reports at a scrape."""

    kv_cache_usage_ratio: float
    prefix_cache_hit_ratio: float
    running: int
    waiting: int
    prefill_tokens_per_second: float


class EngineCollector(Collector):
    """A worker's engine gauges, read at each scrape from ``state()``."""

    def __init__(self, state: Callable[[], EngineState], labels: dict[str, str]) -> None:
        self.state, self.labels = state, labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.state()
        names = list(self.labels)
        values = list(self.labels.values())
        for name, doc, value in (
                ("kvrelay_kv_cache_usage_ratio", "Share of the KV blocks in use (0 to 1)", st.kv_cache_usage_ratio),
                ("kvrelay_prefix_cache_hit_ratio", "Prompt blocks found in the prefix cache since start, over "
                 "those looked up", st.prefix_cache_hit_ratio),
                ("kvrelay_num_requests_running", "Sequences in the running batch", st.running),
                ("kvrelay_num_requests_waiting", "Sequences waiting for the engine", st.waiting),
                ("kvrelay_prefill_tokens_per_second", "Prompt tokens per second of prefill compute, since start",
                 st.prefill_tokens_per_second)):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            yield g


class CertificateCollector(Collector):
    """When this process's certificate expires, and how many times it was renewed, read at each
    scrape from its (renewable) TLS material: an alert on ``expiry - time()`` catches a process
    whose renewals stopped arriving before its handshakes start failing."""

    def __init__(self, material: TLSMaterial, labels: dict[str, str]) -> None:
        self.material, self.labels = material, labels
        self._seen: tuple[int, float] = (-1, 0.0)
        """The generation last parsed, and its certificate's end (seconds since the epoch)."""

    def _not_after(self) -> float:
        gen = self.material.generation
        if self._seen[0] != gen:
            pem = self.material.cert_pem
            end = cert_info(load_cert(pem, "certificate")).not_after.timestamp() if pem is not None else 0.0
            self._seen = (gen, end)
        return self._seen[1]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value in (
                ("kvrelay_tls_certificate_expiry_timestamp_seconds", "When this process's certificate expires "
                 "(seconds since the epoch)", self._not_after()),
                ("kvrelay_tls_certificate_renewals", "Times this process took a renewed certificate or CA "
                 "bundle since it started", float(self.material.generation))):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            yield g


class TransferMetrics:
    """KV transfers a decode worker received: bytes and time per link and transport, failures per reason."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.bytes = Counter("kvrelay_kv_transfer_bytes", "KV bytes received", ["link", "transport"], registry=r)
        self.seconds = Histogram("kvrelay_kv_transfer_seconds", "From reservation to the whole KV received",
                                 ["link", "transport"], buckets=TRANSFER_BUCKETS, registry=r)
        self.failures = Counter("kvrelay_kv_transfer_failures", "KV transfers that failed", ["link", "reason"],
                                registry=r)


# -- the endpoint ---------------------------------------------------------------------------------------------------
WILDCARDS = ("0.0.0.0", "::", "")
"""Bind addresses that mean every interface (not an address to scrape)."""


class MetricsServer:
    """``/metrics`` of one registry over HTTP, in a thread of its own."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        server, self._thread = start_http_server(port, addr=host, registry=registry)
        self._server: WSGIServer | None = server
        """None once closed."""
        self.host = host
        self.port = server.server_port
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.advertised(self.host)

    def advertised(self, host: str) -> str:
        """host:port for others to scrape: ``host`` replaces a wildcard bind address
        (and when ``host`` is one too, this machine's name)."""
        if self.host not in WILDCARDS:
            host = self.host
        elif host in WILDCARDS:
            host = socket.getfqdn()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> MetricsServer | None:
    """The process's /metrics server (None when ``port`` is None: metrics off)."""
    return None if port is None else MetricsServer(registry, host, port)


METRIC_NAMES = (
    "kvrelay_time_to_first_token_seconds", "kvrelay_inter_token_latency_seconds",
    "kvrelay_e2e_request_latency_seconds", "kvrelay_queue_time_seconds", "kvrelay_requests_total",
    "kvrelay_tokens_total", "kvrelay_placements_total", "kvrelay_retries_total", "kvrelay_migrations_total",
    "kvrelay_link_up", "kvrelay_link_rate_gbps", "kvrelay_kv_transfer_bytes_total", "kvrelay_kv_transfer_seconds",
    "kvrelay_kv_transfer_failures_total", "kvrelay_kv_cache_usage_ratio", "kvrelay_prefix_cache_hit_ratio",
    "kvrelay_num_requests_running", "kvrelay_num_requests_waiting", "kvrelay_prefill_tokens_per_second",
    "kvrelay_tls_certificate_expiry_timestamp_seconds", "kvrelay_tls_certificate_renewals")
"""Every metric name kvrelay exports (histograms add ``_bucket``, ``_sum`` and ``_count``)."""
