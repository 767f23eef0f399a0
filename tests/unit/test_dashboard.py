"""The Grafana dashboard and the example Prometheus config of observability/:
the dashboard names only metrics kvrelay exports and uses all of them, and
promtool (where installed) accepts every expression and the config."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvrelay.runtime.metrics import METRIC_NAMES, RouterMetrics, TransferMetrics
from tests.dashboard import all_panels, exprs, load_dashboard, substitute

ROOT = Path(__file__).resolve().parents[2]
PROM_CONFIG = ROOT / "observability" / "prometheus" / "prometheus.yml"
METRIC_RE = re.compile(r"kvrelay_[a-z0-9_]+")  # digits too: kvrelay_e2e_...
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")
SAMPLE_TARGETS = [
    {"targets": ["127.0.0.1:9464"], "labels": {"role": "router", "site": "toronto", "worker": "router"}},
    {"targets": ["127.0.0.1:9465"], "labels": {"role": "decode", "site": "toronto", "worker": "toronto-decode-0"}},
]


def histogram_names() -> set[str]:
    """The names of the histograms kvrelay exports, read from the metric definitions."""
    registry = CollectorRegistry()
    RouterMetrics(registry)
    TransferMetrics(registry)
    return {fam.name for fam in registry.collect() if fam.type == "histogram"}


def metric_names(expr: str, histograms: set[str]) -> set[str]:
    """The kvrelay metric names an expression reads (a histogram's series by their base name)."""
    out = set()
    for name in METRIC_RE.findall(expr):
        base = HISTOGRAM_SUFFIX.sub("", name)
        out.add(base if base != name and base in histograms else name)
    return out


def promtool() -> str:
    """promtool's path, or skip."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not on PATH (Debian: apt-get install prometheus); PromQL and config not checked")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    """promtool's result for ``args``."""
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, check=False)


def test_dashboard_parses_with_unique_ids_and_titles():
    dash = load_dashboard()
    panels = list(all_panels(dash["panels"]))
    assert panels
    ids = [p.get("id") for p in panels]
    assert None not in ids
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    assert all(isinstance(p.get("title"), str) and p["title"].strip() for p in panels)
    assert dash["schemaVersion"] >= 36


def test_dashboard_has_its_template_variables():
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("site", "tenant"):
        assert variables[name]["type"] == "query"
        assert "label_values(" in json.dumps(variables[name]["query"])


def test_every_query_uses_the_datasource_variable():
    for p in all_panels(load_dashboard()["panels"]):
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert t["datasource"]["type"] == "prometheus", p["title"]


def test_dashboard_metrics_are_exported_and_all_used():
    histograms = histogram_names()
    assert histograms and histograms <= set(METRIC_NAMES)
    used: set[str] = set()
    for expr in exprs(load_dashboard()):
        names = metric_names(expr, histograms)
        unknown = names - set(METRIC_NAMES)
        assert not unknown, f"{expr} reads metrics kvrelay does not export: {sorted(unknown)}"
        used |= names
    assert set(METRIC_NAMES) - used == set(), "metrics no panel shows"


def test_metric_name_extraction():
    hist = {"kvrelay_queue_time_seconds"}
    assert metric_names("rate(kvrelay_queue_time_seconds_bucket[1m])", hist) == {"kvrelay_queue_time_seconds"}
    assert metric_names("rate(kvrelay_tokens_count[1m])", hist) == {"kvrelay_tokens_count"}
    assert metric_names("kvrelay_e2e_request_latency_seconds_sum", set()) == {"kvrelay_e2e_request_latency_seconds_sum"}
    assert substitute('x{a=~"$site", b=~"${tenant}"}[$__rate_interval]') == 'x{a=~".*", b=~".*"}[1m]'


def test_every_expression_is_valid_promql(tmp_path: Path):
    queries = exprs(load_dashboard())
    assert queries
    lines = ["groups:", "  - name: kvrelay_dashboard", "    rules:"]
    for i, expr in enumerate(queries):
        lines += [f"      - record: kvrelay:test_{i}", f"        expr: {json.dumps(substitute(expr))}"]
    rules = tmp_path / "dashboard-rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    result = run_promtool("check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_prometheus_config_is_valid(tmp_path: Path):
    config = tmp_path / PROM_CONFIG.name
    shutil.copy(PROM_CONFIG, config)
    (tmp_path / "kvrelay-targets.json").write_text(json.dumps(SAMPLE_TARGETS))
    result = run_promtool("check", "config", str(config))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output


def test_prometheus_config_scrapes_the_routers_file():
    text = PROM_CONFIG.read_text()
    assert "scrape_interval: 5s" in text
    assert re.search(r"job_name:\s*kvrelay\b", text)
    assert re.search(r"files:\s*\n\s*-\s*kvrelay-targets\.json", text)
    assert "refresh_interval: 5s" in text
    for word in ("telemetry.prometheus_targets", "telemetry.metrics_host", "metrics_exposed", "# static_configs:"):
        assert word in text
