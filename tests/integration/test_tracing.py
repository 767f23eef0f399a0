"""One trace per request across real processes: the router, the prefill
worker and the decode worker each export their spans (a JSONL file per
process, or OTLP over gRPC to a receiver built here on the collector's
service), and together they make one tree: the router's request and
attempt, the prefill and its KV send, the decode and its KV receive
(linked to the send), with durations that nest and the KV's arrival before
the first token. A migrated request keeps both attempts in one trace; a
client's ``traceparent`` (gRPC metadata or HTTP header) is a link of the
root, never its trace; no prompt text is in any span. The clusters serve the
plumbing model (SmolLM2's tokens, about a twelfth of its cost per token): what
is asserted is the trace, not the answer."""

from __future__ import annotations

import json
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tspb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsgrpc

from kvrelay.cli.main import main as kvrelay
from kvrelay.runtime.tracing import read_spans
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import running_cluster, tls_context, wait_until, workers

pytestmark = pytest.mark.model

PROMPT = "The research networks of Canada, linked city to city across the country by fibre, carry"
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
SLACK_NS = 5_000_000
"""Clock slack between spans of different processes (one host, one clock; rounding)."""


def config(telemetry: dict, decode: int = 1) -> dict:
    return {
        "router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
                   "liveness": {"heartbeat_interval_s": 0.25}},
        "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1},
                   "decode": {"replicas": decode}}],
        "workers": {"threads": 1}, "cache": {"memory_gib": 0.25}, "telemetry": telemetry}


def generate(lc, request_id: str, max_tokens: int = 8, metadata=()) -> list[ipb.GenerateResponse]:
    with lc.channel() as ch:
        return list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
            prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True, request_id=request_id),
            metadata=metadata, timeout=180))


def trace_of(spans: list[dict], request_id: str) -> list[dict]:
    """The spans of the trace whose root names ``request_id`` (none before the root is exported)."""
    ids = {s["trace_id"] for s in spans if s["name"] == "kvrelay.request"
           and s["attributes"].get("kvrelay.request_id") == request_id}
    return [s for s in spans if s["trace_id"] in ids]


def one(spans: list[dict], name: str) -> dict:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, f"{len(found)} spans named {name}: {[s['service'] for s in found]}"
    return found[0]


def event_time(span: dict, name: str) -> int:
    return next(e["time_unix_nano"] for e in span["events"] if e["name"] == name)


def check_disaggregated(spans: list[dict], trace_id: str, model: Path) -> None:
    """The tree of one disaggregated request (served by ``model``), its parent links, times and attributes."""
    assert {s["trace_id"] for s in spans} == {trace_id}
    by_id = {s["span_id"]: s for s in spans}
    root, attempt = one(spans, "kvrelay.request"), one(spans, "kvrelay.attempt")
    prefill, decode = one(spans, "kvrelay.prefill"), one(spans, "kvrelay.decode")
    send, recv = one(spans, "kvrelay.kv.send"), one(spans, "kvrelay.kv.receive")
    gen = one(spans, "kvrelay.decode.generate")
    assert {s["service"] for s in spans} == {"kvrelay-router", "kvrelay-prefill", "kvrelay-decode"}
    assert root["parent_span_id"] is None
    for child, parent in ((attempt, root), (one(spans, "kvrelay.placement"), root), (prefill, attempt),
                          (decode, attempt), (send, prefill), (recv, decode), (gen, decode),
                          (one(spans, "kvrelay.prefill.chunk"), prefill), (one(spans, "kvrelay.tokenize"), root)):
        assert child["parent_span_id"] == parent["span_id"], f"{child['name']} is not a child of {parent['name']}"
    for s in spans:  # every child within its parent's time
        if s["parent_span_id"] is not None:
            p = by_id[s["parent_span_id"]]
            assert p["start_unix_nano"] - SLACK_NS <= s["start_unix_nano"] <= s["end_unix_nano"], s["name"]
            assert s["end_unix_nano"] <= p["end_unix_nano"] + SLACK_NS, f"{s['name']} ends after {p['name']}"
    assert recv["links"] == [{"trace_id": trace_id, "span_id": send["span_id"]}]  # via the KV's last frame
    assert recv["end_unix_nano"] <= event_time(gen, "first_token") + SLACK_NS
    assert recv["end_unix_nano"] <= event_time(root, "kvrelay.first_token") + SLACK_NS
    assert send["attributes"]["kvrelay.kv.bytes"] == recv["attributes"]["kvrelay.kv.bytes"] > 0
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert sum(e["name"] == "layer" for e in send["events"]) >= layers  # every layer of the model, once at least
    a = root["attributes"]
    assert a["gen_ai.request.model"] and a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 8
    assert attempt["attributes"]["kvrelay.placement.mode"] == "disaggregated"
    assert PROMPT not in json.dumps(spans) and "research networks" not in json.dumps(spans)


# -- the file exporter: one cluster with two decode workers ------------------------------------------------------
@pytest.fixture(scope="module")
def traced(plumbing_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    raw = config({"traces": "file", "file": str(folder / "{process}.jsonl")}, decode=2)
    with running_cluster(raw, plumbing_model, reconcile=False) as lc:
        yield lc, folder


def spans_in(folder, request_id: str, want: set[str]) -> list[dict]:
    """The request's spans once every name in ``want`` was exported (exports lag by half a second)."""
    found: list[dict] = []

    def ready() -> bool:
        nonlocal found
        found = trace_of(read_spans(sorted(folder.glob("*.jsonl"))), request_id)
        return want <= {s["name"] for s in found}
    assert wait_until(ready, 30), f"spans of {request_id}: {sorted(s['name'] for s in found)}"
    return found


ALL = {"kvrelay.request", "kvrelay.attempt", "kvrelay.prefill", "kvrelay.decode", "kvrelay.kv.send",
       "kvrelay.kv.receive", "kvrelay.decode.generate"}


def test_a_disaggregated_request_is_one_trace_across_three_processes(traced, capsys):
    lc, folder = traced
    msgs = generate(lc, "trace-one")
    trace_id = msgs[-1].finish.placement.trace_id
    assert len(trace_id) == 32
    check_disaggregated(spans_in(folder, "trace-one", ALL), trace_id, lc.model_path)
    capsys.readouterr()
    assert kvrelay(["trace", "trace-one", "--dir", str(folder)]) == 0
    shown = capsys.readouterr().out
    for name in ("kvrelay.request", "kvrelay.kv.send", "kvrelay.kv.receive", "first_token"):
        assert name in shown


def test_a_client_traceparent_is_a_link_never_the_trace(traced):
    """A client's span is linked from the request's root, whose trace is the router's own: a client
    cannot choose what is sampled, nor add spans to a trace id it learned from another tenant."""
    lc, folder = traced
    msgs = generate(lc, "trace-client", metadata=(("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),))
    trace_id = msgs[-1].finish.placement.trace_id
    assert len(trace_id) == 32 and trace_id != CLIENT_TRACE
    spans = spans_in(folder, "trace-client", ALL)
    root = one(spans, "kvrelay.request")
    assert root["parent_span_id"] is None
    assert root["links"] == [{"trace_id": CLIENT_TRACE, "span_id": CLIENT_SPAN}]
    assert {s["trace_id"] for s in spans} == {trace_id}
    # over HTTP, as a header
    client = openai.OpenAI(base_url=f"https://{lc.http_address}/v1", api_key=lc.client_token, max_retries=0,
                           timeout=120, http_client=openai.DefaultHttpxClient(verify=tls_context(lc)))
    other = "5bf92f3577b34da6a3ce929d0e0e4737"
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4,
                              extra_headers={"traceparent": f"00-{other}-{CLIENT_SPAN}-01"})
    assert wait_until(lambda: any(s["name"] == "kvrelay.request" and s["parent_span_id"] is None
                                  and s["links"] == [{"trace_id": other, "span_id": CLIENT_SPAN}]
                                  for s in read_spans(sorted(folder.glob("*.jsonl")))), 30)
    assert not [s for s in read_spans(sorted(folder.glob("*.jsonl"))) if s["trace_id"] == other]


def test_a_malformed_traceparent_starts_a_trace_of_its_own(traced):
    lc, folder = traced
    msgs = generate(lc, "trace-bad", metadata=(("traceparent", "00-zz-not-a-trace"),))
    trace_id = msgs[-1].finish.placement.trace_id
    assert len(trace_id) == 32 and trace_id != CLIENT_TRACE
    assert one(spans_in(folder, "trace-bad", ALL), "kvrelay.request")["parent_span_id"] is None


def test_a_migrated_request_shows_both_attempts_in_one_trace(traced):
    lc, folder = traced
    killed = None
    with lc.channel() as ch:
        call = igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
            prompt=PROMPT, max_tokens=400, ignore_eos=True, request_id="trace-migrated"), timeout=300)
        msgs = []
        for msg in call:
            msgs.append(msg)
            if killed is None and sum(len(m.token_ids) for m in msgs) >= 4:  # 396 tokens left: seconds
                busy = [w for w, s in workers(lc).items() if s.info.role == 2 and s.inflight > 0]
                killed = busy[0]
                child = next(c for c in lc.children if c.name == killed)
                child.proc.send_signal(signal.SIGKILL)
                child.proc.wait(10)
    fin = msgs[-1].finish
    assert fin.placement.migrations == 1 and fin.placement.decode_worker != killed
    spans = spans_in(folder, "trace-migrated", {"kvrelay.request", "kvrelay.attempt", "kvrelay.decode"})
    assert {s["trace_id"] for s in spans} == {fin.placement.trace_id}
    attempts = sorted((s for s in spans if s["name"] == "kvrelay.attempt"), key=lambda s: s["start_unix_nano"])
    assert len(attempts) == 2
    assert attempts[0]["status"] == "ERROR" and attempts[1]["status"] != "ERROR"
    assert attempts[0]["attributes"]["kvrelay.decode.worker"] == killed
    assert attempts[1]["attributes"]["kvrelay.decode.worker"] == fin.placement.decode_worker
    root = one(spans, "kvrelay.request")
    assert [e["name"] for e in root["events"]].count("kvrelay.migration") == 1
    survivor = [s for s in spans if s["name"] == "kvrelay.decode"]
    # the killed one's died with it
    assert survivor and all(s["parent_span_id"] == attempts[1]["span_id"] for s in survivor)


# -- OTLP over gRPC ---------------------------------------------------------------------------------------------
def _value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class Receiver(tsgrpc.TraceServiceServicer):
    """An OTLP trace receiver: what a collector would get, as span dicts like the file exporter's."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        for rs in request.resource_spans:
            service = _attrs(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                with self.lock:
                    self.spans.extend(self._span(s, service) for s in ss.spans)
        return tspb.ExportTraceServiceResponse()

    @staticmethod
    def _span(s, service: str) -> dict:
        return {"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                "parent_span_id": s.parent_span_id.hex() or None, "name": s.name, "service": service,
                "start_unix_nano": s.start_time_unix_nano, "end_unix_nano": s.end_time_unix_nano,
                "attributes": _attrs(s.attributes),
                "events": [{"name": e.name, "time_unix_nano": e.time_unix_nano, "attributes": _attrs(e.attributes)}
                           for e in s.events],
                "links": [{"trace_id": lk.trace_id.hex(), "span_id": lk.span_id.hex()} for lk in s.links],
                "status": {0: "UNSET", 1: "OK", 2: "ERROR"}[s.status.code]}


def test_otlp_export_to_a_collector_gives_the_same_trace(plumbing_model):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    tsgrpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with running_cluster(config({"traces": "otlp", "endpoint": f"http://127.0.0.1:{port}"}), plumbing_model) as lc:
            msgs = generate(lc, "trace-otlp")

            def spans() -> list[dict]:
                with receiver.lock:
                    return trace_of(list(receiver.spans), "trace-otlp")
            assert wait_until(lambda: {s["name"] for s in spans()} >= ALL, 30)
            check_disaggregated(spans(), msgs[-1].finish.placement.trace_id, plumbing_model)
    finally:
        server.stop(0)


def test_crafted_client_trace_ids_do_not_force_tracing(plumbing_model, tmp_path):
    """The attack of finding 4 (issue 33): at ``sample_ratio: 0.01``, 120 requests whose traceparents
    carry trace ids a ratio sampler always takes (low 64 bits zero) and the sampled flag. Before, all
    120 were traced under the client's ids; now about 1 is, under a trace id of the router's own."""
    raw = config({"traces": "file", "file": str(tmp_path / "{process}.jsonl"), "sample_ratio": 0.01})
    crafted = [f"{i + 1:016x}{0:016x}" for i in range(120)]

    def one(trace_id: str) -> str:
        header = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),)
        with lc.channel() as ch:
            msgs = list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(prompt="hi", max_tokens=1),
                                                         timeout=120, metadata=header))
        return msgs[-1].finish.placement.trace_id

    with running_cluster(raw, plumbing_model) as lc:
        with futures.ThreadPoolExecutor(4) as pool:
            traced_ids = [t for t in pool.map(one, crafted) if t]
        assert len(traced_ids) <= 12, f"{len(traced_ids)} of 120 traced at a ratio of 0.01"  # ~1 expected
        assert not set(traced_ids) & set(crafted)
        assert len(generate(lc, "after-the-attack", max_tokens=2)[-1].finish.placement.trace_id) in (0, 32)
    assert not {s["trace_id"] for s in read_spans(sorted(tmp_path.glob("*.jsonl")))} & set(crafted)
