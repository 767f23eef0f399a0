"""`kvrelay bench replay` against a real local cluster, on slices of the
public Azure and Mooncake traces (benchmarks/data)."""

from __future__ import annotations

import json
import re

import pytest

from kvrelay.benchmarks.traces import SAMPLE_AZURE, SAMPLE_MOONCAKE
from kvrelay.cli.main import main
from tests.integration.helpers import CLUSTER_YAML, cluster_user, running_cluster, wait_until

AZURE, MOONCAKE = SAMPLE_AZURE, SAMPLE_MOONCAKE

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def span_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("spans")


@pytest.fixture(scope="module")
def traced_cluster(plumbing_model, span_dir):
    """The shared test cluster, tracing every request to span files (this module's only cluster)."""
    raw = {**CLUSTER_YAML, "telemetry": {"traces": "file", "file": str(span_dir / "{process}.jsonl")}}
    with running_cluster(raw, plumbing_model) as lc:
        yield lc


@pytest.mark.parametrize("trace,scale,limit", [(AZURE, 0.1, 10), (MOONCAKE, 0.01, 10)])
def test_replay_reports_every_request(traced_cluster, span_dir, tmp_path, trace, scale, limit, capsys,
                                      monkeypatch):
    out, user = tmp_path / "report", cluster_user(traced_cluster, monkeypatch)
    rc = main(["bench", "replay", "--trace", str(trace), *user, "--limit", str(limit),
               "--speedup", "10", "--length-scale", str(scale), "--slo-ttft", "30", "--slo-tpot", "5",
               "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    assert s["requests"] == s["completed"] == limit and s["failed"] == 0
    assert s["ttft_ms"]["count"] == limit and s["ttft_ms"]["p50"] > 0 and s["e2e_ms"]["p99"] >= s["ttft_ms"]["p99"]
    assert s["request_throughput_rps"] > 0 and 0 < s["slo_attainment"] <= 1
    assert len(report["meta"]["trace_slice"]) == limit and report["meta"]["length_scale"] == scale
    for r, t in zip(report["requests"], report["meta"]["trace_slice"]):  # forced output lengths
        assert len(r["token_times"]) == max(1, round(t["output_tokens"] * scale))
        assert r["input_tokens"] == max(1, round(t["input_tokens"] * scale))
        assert re.fullmatch(r"[0-9a-f]{32}", r["trace_id"]), r["trace_id"]
    assert len({r["trace_id"] for r in report["requests"]}) == limit
    slowest = max(report["requests"], key=lambda r: r["end_s"] - r["sent_s"])["trace_id"]
    router_spans = span_dir / "router.jsonl"
    assert wait_until(lambda: router_spans.is_file() and slowest in router_spans.read_text(), 15)  # batched
    capsys.readouterr()
    assert main(["trace", slowest, "--dir", str(span_dir)]) == 0  # an outlier's trace opens
    assert capsys.readouterr().out.startswith(f"trace {slowest}:")
    assert {"local/prefill/0", "local/decode/0"} <= set(report["per_worker"])
    assert sum(row["kv_bytes"] for row in report["per_link"].values()) > 0
    md = (out / "report.md").read_text()
    assert "TTFT" in md and "Goodput" in md
    for png in ("ttft_cdf.png", "tpot_cdf.png", "throughput.png", "kv_bytes_per_link.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({png})" in md


def test_replay_refuses_lengths_over_the_context_without_a_scale(traced_cluster, tmp_path, capsys, monkeypatch):
    user = cluster_user(traced_cluster, monkeypatch)
    rc = main(["bench", "replay", "--trace", str(MOONCAKE), *user, "--limit", "3",
               "--no-progress", "--out", str(tmp_path / "r")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "exceed" in err and "--length-scale" in err
    assert not (tmp_path / "r").exists()
