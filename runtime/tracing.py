"""OpenTelemetry traces of one kvrelay process: its tracer (per
``telemetry.traces``: none, OTLP over gRPC to a collector, or a JSONL file),
and W3C ``traceparent`` propagation in gRPC metadata and KV messages.

Spans are started with an explicit parent (``parent=`` a context from
:func:`context_from_metadata`, or ``within(span)``), never through the
ambient context: the request path runs in async generators and in engine and
transport threads, where an implicit current span would be the wrong one.

Span names and attributes (``kvrelay.*`` for our own; the GenAI semantic
conventions' ``gen_ai.*`` where they exist) carry no prompt or output text.

The JSONL file holds one span per line (:func:`span_record`): ``trace_id``,
``span_id``, ``parent_span_id`` (hex; null at a root), ``name``, ``kind``,
``service``, ``start_unix_nano``, ``end_unix_nano``, ``attributes``,
``events`` (``name``, ``time_unix_nano``, ``attributes``), ``links``
(``trace_id``, ``span_id``), ``status``, ``status_message``. `kvrelay trace`
reads it."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvrelay.runtime.config import TelemetrySection, TraceExport

TRACEPARENT = "traceparent"
"""The W3C header / gRPC metadata key that carries a span's context."""

_TRACEPARENT_RE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_PROPAGATOR = TraceContextTextMapPropagator()
EXPORT_DELAY_MS = 500
"""Longest a finished span waits in its process before it is exported."""
SHUTDOWN_S = 5.0
"""Longest a process waits at exit for its last spans to be exported."""
SCOPE = "kvrelay"


# -- propagation --------------------------------------------------------------------------------------------------
def parse_traceparent(value: str | bytes | None) -> SpanContext | None:
    """The remote span a W3C ``traceparent`` names; None when it is absent or
    malformed (a bad header from a client or peer is ignored, never an error)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not value or len(value) > 64:
        return None
    m = _TRACEPARENT_RE.fullmatch(value.strip().lower())
    if m is None or set(m.group(1)) == {"0"} or set(m.group(2)) == {"0"}:
        return None
    return SpanContext(int(m.group(1), 16), int(m.group(2), 16), is_remote=True,
                       trace_flags=TraceFlags(int(m.group(3), 16) & 1))


def remote_parent(value: str | bytes | None) -> Context | None:
    """A context whose parent is the span ``traceparent`` names (None: no valid one)."""
    sc = parse_traceparent(value)
    return None if sc is None else trace.set_span_in_context(trace.NonRecordingSpan(sc))


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The caller's span context from gRPC invocation metadata (None: none sent)."""
    for key, value in metadata or ():
        if key == TRACEPARENT:
            return remote_parent(value)
    return None


def traceparent(span: Span | None) -> str:
    """``span``'s W3C traceparent ("" when it has no valid context)."""
    if span is None:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def metadata_for(span: Span | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that makes the callee's spans children of ``span``."""
    tp = traceparent(span)
    return ((TRACEPARENT, tp),) if tp else ()


def trace_id_of(span: Span | None) -> str:
    """``span``'s trace id in hex, "" unless it is sampled (exported)."""
    ctx = span.get_span_context() if span is not None else None
    if ctx is None or not ctx.is_valid or not ctx.trace_flags.sampled:
        return ""
    return format(ctx.trace_id, "032x")


def within(span: Span | None) -> Context | None:
    """A context whose current span is ``span``: the ``parent`` of its children."""
    return None if span is None else trace.set_span_in_context(span)


def link_to(value: str | None) -> list[Link]:
    """A span link to the span a peer's traceparent names (none when invalid)."""
    sc = parse_traceparent(value)
    return [] if sc is None else [Link(sc)]


# -- the file exporter ----------------------------------------------------------------------------------------------
def _hex(n: int | None, width: int) -> str | None:
    return None if n is None else format(n, f"0{width}x")


def _attrs(attributes: Mapping | None) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in (attributes or {}).items()}


def span_record(span: ReadableSpan) -> dict:
    """One finished span as a line of the JSONL file (the format the module docstring gives)."""
    ctx = span.context
    return {
        "trace_id": _hex(ctx.trace_id, 32), "span_id": _hex(ctx.span_id, 16),
        "parent_span_id": _hex(span.parent.span_id, 16) if span.parent is not None else None,
        "name": span.name, "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name", ""),
        "start_unix_nano": span.start_time, "end_unix_nano": span.end_time,
        "attributes": _attrs(span.attributes),
        "events": [{"name": e.name, "time_unix_nano": e.timestamp, "attributes": _attrs(e.attributes)}
                   for e in span.events],
        "links": [{"trace_id": _hex(lk.context.trace_id, 32), "span_id": _hex(lk.context.span_id, 16)}
                  for lk in span.links],
        "status": span.status.status_code.name, "status_message": span.status.description or "",
    }


class JsonlSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line to a file (0600; a folder it
    makes, 0700). At ``max_bytes`` the file becomes ``<name>.1.jsonl`` (the one
    before is replaced) and a new one starts."""

    def __init__(self, path: str | Path, max_bytes: int = 256 << 20) -> None:
        self.path, self.max_bytes = Path(path), max_bytes
        self.path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)  # workers may start at once
        self._lock = threading.Lock()
        self._file = self._open()

    def _open(self):
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        return os.fdopen(fd, "a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            try:
                if self._file.tell() + len(lines) > self.max_bytes:
                    self._file.close()
                    os.replace(self.path, self.path.with_suffix(".1.jsonl"))
                    self._file = self._open()
                self._file.write(lines)
                self._file.flush()
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_FIELDS: dict[str, type | tuple[type, ...]]
_FIELDS = {"trace_id": str, "span_id": str, "name": str, "start_unix_nano": int, "end_unix_nano": (int, type(None)),
           "parent_span_id": (str, type(None)), "attributes": dict, "events": list, "links": list}
"""The fields of a span record and their types (anything else in a file is refused)."""


def _check_record(rec) -> str | None:
    """What is wrong with a span record (None: nothing)."""
    if not isinstance(rec, dict):
        return "not an object"
    for key, kind in _FIELDS.items():
        if (key in rec and not isinstance(rec[key], kind)) or isinstance(rec.get(key), bool):
            return f"field {key!r} has the wrong type"
    missing = [k for k in ("trace_id", "span_id", "name", "start_unix_nano") if k not in rec]
    if missing:
        return f"it lacks {', '.join(missing)}"
    if any(not isinstance(e, dict) or not isinstance(e.get("time_unix_nano", 0), int) for e in rec.get("events", [])):
        return "an event is not an object with an integer time_unix_nano"
    return None


def read_spans(paths: Iterable[str | Path]) -> list[dict]:
    """Every span in the JSONL files ``paths`` (a torn last line, from a process
    killed mid-write, is skipped; any other bad line or record raises ValueError naming it)."""
    spans = []
    for path in paths:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                if i == len(lines) - 1:
                    break
                raise ValueError(f"{path}:{i + 1}: not a span record ({exc.msg})") from None
            problem = _check_record(rec)
            if problem is not None:
                raise ValueError(f"{path}:{i + 1}: not a span record ({problem})")
            spans.append(rec)
    return spans


# -- the process's tracer ----------------------------------------------------------------------------------------
def _otlp_exporter(section: TelemetrySection) -> SpanExporter:
    scheme, _, address = (section.endpoint or "").partition("://")
    if scheme == "http":
        return OTLPSpanExporter(endpoint=address.rstrip("/"), insecure=True, timeout=10)
    ca = Path(section.ca_file).read_bytes() if section.ca_file else None
    return OTLPSpanExporter(endpoint=address.rstrip("/"), insecure=False, timeout=10,
                            credentials=grpc.ssl_channel_credentials(root_certificates=ca))


class Tracing:
    """One process's tracer: ``tracing.tracer.start_span(name, context=parent)``.
    With ``traces: none`` it is a no-op tracer (spans cost nothing and record nothing)."""

    def __init__(self, section: TelemetrySection, service: str, process: str,
                 attributes: Mapping[str, str] | None = None, follow_remote: bool = True) -> None:
        """``service``: ``kvrelay-router``, ``kvrelay-prefill`` or ``kvrelay-decode``;
        ``process``: this process's name in file names (``router``, ``toronto-decode-0``).
        ``follow_remote``: a remote parent's sampled flag decides (workers: their
        parent is the router); False (the router, whose remote parents are clients):
        ``sample_ratio`` decides on the trace id, whatever flag a client sent."""
        self.section = section
        self.provider: TracerProvider | None = None
        self.file: Path | None = None
        if section.traces is TraceExport.NONE:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        resource = Resource({"service.name": service, "service.instance.id": process, **(attributes or {})})
        ratio = TraceIdRatioBased(section.sample_ratio)
        sampler = ParentBased(ratio) if follow_remote else ParentBased(
            ratio, remote_parent_sampled=ratio, remote_parent_not_sampled=ratio)
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        if section.traces is TraceExport.FILE:
            self.file = Path(section.file.format(process=process))
            exporter: SpanExporter = JsonlSpanExporter(self.file, section.file_max_bytes)
        else:
            exporter = _otlp_exporter(section)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer(SCOPE)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def start(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
              attributes: Mapping | None = None, start_ns: int | None = None,
              links: Sequence[Link] = ()) -> Span:
        """A new span, child of ``parent`` (None: a root, or a child of nothing)."""
        return self.tracer.start_span(name, context=parent if parent is not None else Context(), kind=kind,
                                      attributes=attributes, start_time=start_ns, links=links)

    def flush(self, timeout_s: float = SHUTDOWN_S) -> None:
        if self.provider is not None:
            self.provider.force_flush(int(timeout_s * 1e3))

    def shutdown(self) -> None:
        """Exports what is left (at most SHUTDOWN_S) and stops."""
        if self.provider is not None:
            self.provider.force_flush(int(SHUTDOWN_S * 1e3))
            self.provider.shutdown()
            self.provider = None
            self.tracer = trace.NoOpTracer()


NO_TRACING = Tracing(TelemetrySection(), "kvrelay", "none")
"""A tracer that records nothing (tests, tools, and ``traces: none``)."""


def process_name(worker_id: str) -> str:
    """A worker id (``site/role/index``) as a file-name part (``site-role-index``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", worker_id)
