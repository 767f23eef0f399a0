"""The pieces of telemetry that need no cluster: the config section's rules,
traceparent parsing (a peer's or client's header is never trusted beyond
its syntax), the file exporter's lines, failure reasons as a closed set,
the recent-latency windows, and retries and migrations surviving a router
restart through the usage database."""

from __future__ import annotations

import os
import re
import stat

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.router.cluster.usage import UsageLedger
from kvrelay.router.core.observe import RETRIES, LinkRates, RecentWindow, RouterTelemetry
from kvrelay.router.placement.link_estimate import LinkState
from kvrelay.runtime.config import ConfigError, TelemetrySection, TraceExport, parse_config
from kvrelay.runtime.metrics import METRIC_NAMES, FailureReason, failure_reason
from kvrelay.runtime.tracing import (
    Tracing,
    metadata_for,
    parse_traceparent,
    read_spans,
    remote_parent,
    trace_id_of,
    traceparent,
    within,
)

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("telemetry, message", [
    ({"traces": "jaeger"}, "telemetry.traces: must be none, otlp or file"),
    ({"traces": "otlp"}, "telemetry.endpoint: traces: otlp needs endpoint"),
    ({"traces": "otlp", "endpoint": "http://10.1.2.3:4317"}, "would send spans in plaintext off this host"),
    ({"traces": "otlp", "endpoint": "collector:4317"}, "telemetry.endpoint"),
    ({"traces": "file", "file": "traces.jsonl"}, "telemetry.file: must contain {process}"),
    ({"sample_ratio": 1.5}, "telemetry.sample_ratio: must be <= 1"),
    ({"sample_ratio": -0.5}, "telemetry.sample_ratio: must be"),
    ({"metrics_host": "0.0.0.0"}, "telemetry.metrics_host: 0.0.0.0 is not a loopback address"),
    ({"router_metrics_port": 70000}, "telemetry.router_metrics_port: must be <= 65535"),
    ({"prometheus": True}, "telemetry: unknown field(s) prometheus"),
    ({"traces": "otlp", "endpoint": "http://127.evil.example:4317"}, "would send spans in plaintext off this host"),
    ({"metrics_host": "127.attacker.net"}, "is not a loopback address"),
    ({"traces": "file", "file": "x/{process}-{pid}.jsonl"}, "and no other {field}"),
    ({"file": "x/{process.jsonl"}, "telemetry.file: 'x/{process.jsonl' is not a valid template"),
    ({"router_metrics_port": -5}, "telemetry.router_metrics_port: must be a port in [0, 65535] or null"),
    ({"traces": "otlp", "endpoint": "https://c:99999"}, "is not in [1, 65535]"),
    ({"traces": "file", "endpoint": "https://c:4317"}, "telemetry.endpoint: is only used with traces: otlp"),
    ({"ca_file": "/etc/ca.pem"}, "telemetry.ca_file: is only used with traces: otlp"),
    ({"traces": "otlp", "endpoint": "http://127.0.0.1:4317", "ca_file": "/etc/ca.pem"},
     "telemetry.ca_file: is only used with an https:// endpoint"),
])
def test_the_telemetry_section_refuses_what_cannot_work(telemetry, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"telemetry": telemetry})


def test_the_telemetry_section_accepts_a_collector_and_exposed_metrics():
    cfg = parse_config({"telemetry": {"traces": "otlp", "endpoint": "https://collector.example:4317",
                                      "metrics_host": "0.0.0.0", "metrics_exposed": True, "sample_ratio": 0.1}})
    assert cfg.telemetry.traces is TraceExport.OTLP and cfg.telemetry.sample_ratio == 0.1
    assert parse_config({}).telemetry.traces is TraceExport.NONE  # off unless asked for


@pytest.mark.parametrize("value", [
    "", "garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", GOOD + "-extra", GOOD.replace("4bf9", "4bg9"),
    "x" * 10_000, b"\xff\xfe"])
def test_a_malformed_traceparent_is_ignored(value):
    assert parse_traceparent(value) is None


def test_a_traceparent_round_trips_through_a_span(tmp_path):
    sc = parse_traceparent(GOOD.upper())
    assert sc is not None and format(sc.trace_id, "032x") == GOOD[3:35] and sc.trace_flags.sampled
    tr = Tracing(TelemetrySection(traces=TraceExport.FILE, file=str(tmp_path / "t" / "{process}.jsonl")), "svc", "p")
    span = tr.start("kvrelay.request", remote_parent(GOOD), attributes={"kvrelay.tenant": "lab-a"})
    child = tr.start("kvrelay.attempt", within(span))
    assert metadata_for(child)[0][0] == "traceparent" and traceparent(child).startswith("00-" + GOOD[3:35])
    child.add_event("layer", {"kvrelay.layer": 3})
    child.end()
    span.end()
    assert trace_id_of(span) == GOOD[3:35]
    tr.shutdown()
    spans = read_spans([tmp_path / "t" / "p.jsonl"])
    assert [s["name"] for s in spans] == ["kvrelay.attempt", "kvrelay.request"]
    assert spans[1]["parent_span_id"] == GOOD[36:52] and spans[0]["parent_span_id"] == spans[1]["span_id"]
    assert spans[0]["events"][0]["attributes"] == {"kvrelay.layer": 3} and spans[1]["service"] == "svc"
    assert stat.S_IMODE(os.stat(tmp_path / "t" / "p.jsonl").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "t").st_mode) == 0o700


def test_sampling_zero_records_nothing_but_a_sampled_client_is_followed(tmp_path):
    tr = Tracing(TelemetrySection(traces=TraceExport.FILE, file=str(tmp_path / "{process}.jsonl"), sample_ratio=0.0),
                 "svc", "p")
    assert trace_id_of(tr.start("kvrelay.request")) == ""
    assert trace_id_of(tr.start("kvrelay.request", remote_parent(GOOD))) == GOOD[3:35]  # parent-based
    tr.shutdown()


@pytest.mark.parametrize("message, reason", [
    ("KV did not arrive before the lease expired (lease timeout)", FailureReason.TIMEOUT),
    ("frame failed authentication", FailureReason.INTEGRITY),
    ("receiver refused the connection: certificate names kvrelay://x", FailureReason.REFUSED),
    ("connection to 10.0.0.2:5555 failed: [Errno 104] Connection reset by peer", FailureReason.CONNECTION),
    ("cancelled", FailureReason.CANCELLED),
    ("something new", FailureReason.OTHER),
])
def test_transfer_failures_fall_into_a_closed_set_of_reasons(message, reason):
    assert failure_reason(message) is reason


def test_recent_windows_forget_what_is_older_than_a_minute():
    now = [0.0]
    w, rates = RecentWindow(60, lambda: now[0]), LinkRates(60, lambda: now[0])
    for v in (0.1, 0.2, 0.3, 0.4, 1.0):
        w.add(v)
    rates.add("a-b", 600)
    rates.add("", 100)  # colocated: no link
    assert w.quantile(0.5) == 0.3 and w.quantile(0.9) == 1.0 and rates.per_s() == {"a-b": 10.0}
    now[0] = 61.0
    assert w.values() == [] and w.quantile(0.5) == 0.0 and rates.per_s() == {}


def test_retries_and_migrations_survive_a_router_restart(tmp_path):
    db = str(tmp_path / "usage.db")
    tel = RouterTelemetry(registry=CollectorRegistry(), durable=UsageLedger(db))
    for _ in range(3):
        tel.count(RETRIES)
    tel.count("migrations")
    restarted = RouterTelemetry(registry=CollectorRegistry(), durable=UsageLedger(db))  # the same file
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(restarted.registry).decode())}
    assert families["kvrelay_retries"].samples[0].value == 3.0
    assert families["kvrelay_migrations"].samples[0].value == 1.0


def test_every_router_metric_is_named_in_the_list():
    tel = RouterTelemetry(registry=CollectorRegistry(), links=lambda: [
        LinkState("a-b", True, 0.0487, "measured"), LinkState("b-c", False, 10.0, "configured"),
        LinkState("local", True, 12.5, "lower bound", probed=False)])
    text = generate_latest(tel.registry).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"kvrelay_link_up", "kvrelay_link_rate_gbps", "kvrelay_time_to_first_token_seconds",
            "kvrelay_requests"} <= names
    for name in names:
        assert any(m.startswith(name) for m in METRIC_NAMES), name
    assert 'kvrelay_link_up{link="b-c"} 0.0' in text
    assert 'kvrelay_link_rate_gbps{link="a-b",source="measured"} 0.0487' in text
    assert 'kvrelay_link_rate_gbps{link="local",source="lower bound"} 12.5' in text
    assert 'kvrelay_link_up{link="local"}' not in text  # within a site: not probed


def test_the_router_samples_by_its_own_ratio_whatever_flag_a_client_sends(tmp_path):
    """A client cannot force tracing (filling the files) nor switch it off; workers follow the router."""
    off = TelemetrySection(traces=TraceExport.FILE, file=str(tmp_path / "{process}.jsonl"), sample_ratio=0.0)
    on = TelemetrySection(traces=TraceExport.FILE, file=str(tmp_path / "{process}.jsonl"), sample_ratio=1.0)
    router_off, router_on = Tracing(off, "r", "a", follow_remote=False), Tracing(on, "r", "b", follow_remote=False)
    unsampled = GOOD[:-2] + "00"
    assert trace_id_of(router_off.start("kvrelay.request", remote_parent(GOOD))) == ""
    assert trace_id_of(router_on.start("kvrelay.request", remote_parent(unsampled))) == GOOD[3:35]
    for t in (router_off, router_on):
        t.shutdown()


def test_a_trace_file_is_rotated_at_its_size_limit(tmp_path):
    path = tmp_path / "p.jsonl"
    tr = Tracing(TelemetrySection(traces=TraceExport.FILE, file=str(tmp_path / "{process}.jsonl"),
                                  file_max_bytes=1 << 20), "svc", "p")
    exporter = tr.provider._active_span_processor._span_processors[0].span_exporter
    exporter.max_bytes = 4096  # the section's floor is 1 MiB; a small limit keeps the test fast
    for i in range(60):
        tr.start("kvrelay.request", attributes={"kvrelay.request_id": f"r{i}"}).end()
        tr.flush()
    tr.shutdown()
    assert path.stat().st_size <= 4096 and (tmp_path / "p.1.jsonl").stat().st_size <= 4096
    assert len(read_spans([tmp_path / "p.1.jsonl", path])) < 60  # the oldest were dropped
