"""Metrics on real processes, scraped by a real Prometheus: the router keeps a
``file_sd`` targets file (telemetry.prometheus_targets) listing its own and
every worker's /metrics; a Prometheus server pointed at that file must find
all three targets up, and after a short disaggregated workload its answers
must agree with what the clients saw: the TTFT histogram's median within the
clients' TTFTs, the KV bytes the decode worker counted equal to the
placements' kv_bytes, requests and completion tokens equal to what was sent
and received. Every exposition must parse and pass ``promtool check
metrics``, and no request id may be a label (bounded cardinality)."""

from __future__ import annotations

import json
import math
import random
import re
import secrets
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.runtime.addresses import free_port
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.dashboard import exprs, load_dashboard, substitute
from tests.integration.helpers import (
    CLUSTER_YAML,
    running_cluster,
    wait_until,
    workers,
)

pytestmark = pytest.mark.model

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
if PROMETHEUS is None or PROMTOOL is None:
    pytest.skip("needs Prometheus (prometheus and promtool on PATH): `make test` installs Debian's prometheus "
                "package", allow_module_level=True)

N_REQUESTS, CONCURRENCY, MAX_TOKENS, PROMPT_TOKENS = 12, 3, 8, 160
"""The workload: every prompt is disaggregated (CLUSTER_YAML's colocate_below_tokens is 0)."""
RUN = secrets.token_hex(4)
REQUEST_IDS = [f"metrics-{RUN}-{i}" for i in range(N_REQUESTS)]
WARMUP_ID = f"metrics-{RUN}-warmup"
ROLES = {"router", "prefill", "decode"}
FAMILIES = {
    # what each role's /metrics must expose (families as the parser names them: counters lose _total)
    "router": {"kvrelay_time_to_first_token_seconds", "kvrelay_inter_token_latency_seconds",
               "kvrelay_e2e_request_latency_seconds", "kvrelay_queue_time_seconds", "kvrelay_requests",
               "kvrelay_tokens", "kvrelay_placements", "kvrelay_retries", "kvrelay_migrations"},
    "prefill": {"kvrelay_kv_cache_usage_ratio", "kvrelay_prefix_cache_hit_ratio", "kvrelay_num_requests_running",
                "kvrelay_num_requests_waiting", "kvrelay_prefill_tokens_per_second"},
    "decode": {"kvrelay_kv_cache_usage_ratio", "kvrelay_prefix_cache_hit_ratio", "kvrelay_num_requests_running",
               "kvrelay_num_requests_waiting", "kvrelay_prefill_tokens_per_second", "kvrelay_kv_transfer_bytes",
               "kvrelay_kv_transfer_seconds"},
}
TTFT_P50 = "histogram_quantile(0.5, sum by (le) (rate(kvrelay_time_to_first_token_seconds_bucket[1m])))"


# -- a Prometheus server ---------------------------------------------------------------------------------------------

def http_get(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


class Prometheus:
    """A Prometheus server (subprocess) scraping every second what the router's targets file lists."""

    def __init__(self, root, targets_file) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = root / "prometheus.yml"
        # JSON is YAML: the scrape config, as observability/prometheus/prometheus.yml but every second
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "kvrelay", "metrics_path": "/metrics", "scheme": "http",
                                "honor_labels": True,
                                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}]}],
        }, indent=1))
        self.log_path = root / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (Prometheus's output, closed by stop())
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited with code {self.proc.returncode}:\n{self.log()}"
        try:
            http_get(f"{self.url}/-/ready", 2.0)
            return True
        except OSError:  # not listening yet, or 503 while it starts
            return False

    def api(self, path: str, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        body = json.loads(http_get(f"{self.url}/api/v1/{path}{query}"))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        return data["result"]

    def scalar(self, promql: str) -> float | None:
        """The single value of an aggregation (None while it has no series)."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# -- the workload -------------------------------------------------------------------------------------------------
@dataclass
class Reply:
    request_id: str
    ttft_s: float
    tokens: int
    finish: ipb.Finish


@dataclass
class Traffic:
    """What the clients sent and saw: the warm-up request, then the workload's."""

    warmup: Reply
    replies: list[Reply] = field(default_factory=list)

    @property
    def all(self) -> list[Reply]:
        return [self.warmup, *self.replies]


def generate(stub, request_id: str, ids: list[int]) -> Reply:
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=MAX_TOKENS, ignore_eos=True,
                              request_id=request_id)
    t0 = time.perf_counter()
    ttft, tokens, finish = None, 0, None
    for msg in stub.Generate(req, timeout=300):
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += len(msg.token_ids)
        if msg.HasField("finish"):
            finish = msg.finish
    assert ttft is not None and finish is not None, request_id
    return Reply(request_id, ttft, tokens, finish)


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]


# -- fixtures ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def targets_file(tmp_path_factory):
    return tmp_path_factory.mktemp("prometheus-sd") / "targets.json"


@pytest.fixture(scope="module")
def metrics_cluster(plumbing_model, targets_file):
    raw = {**CLUSTER_YAML, "telemetry": {"prometheus_targets": str(targets_file)}}
    with running_cluster(raw, plumbing_model) as lc:
        assert wait_until(lambda: sum(w.healthy for w in workers(lc).values()) == 2, 60)
        yield lc


@pytest.fixture(scope="module")
def prometheus(metrics_cluster, targets_file, tmp_path_factory):
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), targets_file)
    try:
        assert wait_until(prom.ready, 30, 0.25), f"prometheus not ready within 30 s:\n{prom.log()}"
        yield prom
    finally:
        prom.stop()


def targets_by_role(prom: Prometheus) -> dict[str, dict]:
    return {t["labels"].get("role", ""): t for t in prom.targets()}


@pytest.fixture(scope="module")
def up_targets(prometheus) -> dict[str, dict]:
    """Prometheus's targets by role, once all three are up (the targets file is
    rewritten every 2 s, read every 1 s, each target scraped every 1 s)."""
    seen: dict[str, dict] = {}

    def all_up() -> bool:
        seen.clear()
        seen.update(targets_by_role(prometheus))
        return set(seen) == ROLES and all(t["health"] == "up" for t in seen.values())
    assert wait_until(all_up, 30, 0.5), f"targets: {json.dumps(seen, indent=1)}\n{prometheus.log()}"
    return dict(seen)


@pytest.fixture(scope="module")
def metrics_stub(metrics_cluster):
    """The public gRPC API of this module's cluster."""
    with metrics_cluster.channel() as ch:
        yield igrpc.InferenceStub(ch)


@pytest.fixture(scope="module")
def traffic(metrics_stub, prometheus, up_targets) -> Traffic:
    """One warm-up request, scraped before the workload (its TTFT series then already
    exists in Prometheus, so ``rate`` over the window counts exactly the workload's
    observations, and the cold first request is not among them); then the workload;
    then until Prometheus has scraped its end."""
    rng = random.Random(RUN)
    traffic = Traffic(generate(metrics_stub, WARMUP_ID, prompt(rng)))
    assert wait_until(lambda: prometheus.scalar("sum(kvrelay_time_to_first_token_seconds_count)") == 1
                      and prometheus.scalar('sum(kvrelay_requests_total{outcome="ok"})') == 1, 30, 0.5), \
        "Prometheus never saw the warm-up request"
    time.sleep(1.5)  # one more scrape: the window's first sample already holds the warm-up
    prompts = [prompt(rng) for _ in REQUEST_IDS]
    lock = threading.Lock()

    def one(i: int) -> None:
        reply = generate(metrics_stub, REQUEST_IDS[i], prompts[i])
        with lock:
            traffic.replies.append(reply)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(one, range(N_REQUESTS)))
    n = len(traffic.all)
    assert wait_until(lambda: prometheus.scalar('sum(kvrelay_requests_total{outcome="ok"})') == n
                      and prometheus.scalar("sum(kvrelay_time_to_first_token_seconds_count)") == n
                      and prometheus.scalar("sum(kvrelay_kv_transfer_bytes_total)")
                      == sum(r.finish.placement.kv_bytes for r in traffic.all), 30, 0.5), \
        "Prometheus never caught up with the workload"
    time.sleep(2.5)  # at least two more scrapes of every target
    return traffic


def expositions(metrics_cluster) -> dict[str, str]:
    """Every process's /metrics, by role, fetched directly."""
    addrs = {"router": metrics_cluster.metrics_address}
    for w in workers(metrics_cluster).values():
        addrs["prefill" if "/prefill/" in w.info.worker_id else "decode"] = w.info.metrics_address
    assert set(addrs) == ROLES and all(addrs.values()), addrs
    return {role: http_get(f"http://{addr}/metrics") for role, addr in addrs.items()}


# -- the tests -----------------------------------------------------------------------------------------------------
def test_targets_file_lists_every_process_and_prometheus_scrapes_them(metrics_cluster, up_targets, targets_file):
    entries = json.loads(targets_file.read_text())
    by_role = {e["labels"]["role"]: e for e in entries}
    assert len(entries) == 3 and set(by_role) == ROLES, entries
    assert by_role["router"]["targets"] == [metrics_cluster.metrics_address]
    assert by_role["router"]["labels"]["worker"] == "router"
    listed = {w.info.worker_id: w.info.metrics_address for w in workers(metrics_cluster).values()}
    for role in ("prefill", "decode"):
        e = by_role[role]
        assert e["labels"] == {"role": role, "site": "local", "worker": f"local/{role}/0"}, e
        assert e["targets"] == [listed[f"local/{role}/0"]]
    for role, t in up_targets.items():
        assert t["scrapeUrl"] == f"http://{by_role[role]['targets'][0]}/metrics", t
        # an empty label is no label to Prometheus (the router's site: router.site is not set)
        assert {k: t["labels"].get(k, "") for k in ("role", "site", "worker")} == by_role[role]["labels"], t
        assert t["lastError"] == "", t


def test_prometheus_agrees_with_what_the_clients_saw(prometheus, traffic):
    replies = traffic.replies
    assert len(replies) == N_REQUESTS
    assert all(not r.finish.placement.colocated and r.finish.placement.kv_bytes > 0 for r in traffic.all)
    assert all(r.tokens == MAX_TOKENS for r in traffic.all)
    ttfts = [r.ttft_s for r in replies]
    p50 = prometheus.scalar(TTFT_P50)
    # The router measures from a request's arrival to its first token, a little less
    # than the client's (channel, TLS record, decoding), and histogram_quantile
    # interpolates linearly inside the bucket that holds the median: anywhere between
    # that bucket's bounds, which are at most a factor of 2 apart in LATENCY_BUCKETS.
    # Its result thus lies within [min/2, 1.5 max] of the observed values; exact
    # bounds would be flaky. A metric off by 10x (ms for s, a wrong clock) still fails
    # unless the clients' TTFTs themselves spread over more than that.
    lo, hi = min(ttfts) * 0.5, max(ttfts) * 1.5
    assert p50 is not None and math.isfinite(p50), f"{TTFT_P50} = {p50}"
    router_ttfts = sorted(round(r.finish.placement.ttft_ms / 1e3, 4) for r in replies)
    assert lo <= p50 <= hi, f"TTFT p50 {p50:.4f} s not in [{lo:.4f}, {hi:.4f}]; clients saw " \
        f"{sorted(round(t, 4) for t in ttfts)}, the router {router_ttfts}"
    # counters are exact: every request the clients made, the warm-up included
    kv_bytes = sum(r.finish.placement.kv_bytes for r in traffic.all)
    assert prometheus.scalar("sum(kvrelay_kv_transfer_bytes_total)") == kv_bytes
    assert prometheus.scalar("sum(kvrelay_kv_transfer_failures_total)") in (None, 0.0)
    assert prometheus.scalar('sum(kvrelay_requests_total{outcome="ok"})') == len(traffic.all) == N_REQUESTS + 1
    assert prometheus.scalar("sum(kvrelay_requests_total)") == len(traffic.all)
    assert prometheus.scalar('sum(kvrelay_tokens_total{kind="completion"})') == sum(r.tokens for r in traffic.all)
    assert prometheus.scalar('sum(kvrelay_tokens_total{kind=~"prompt|cached"})') == \
        sum(r.finish.usage.prompt_tokens for r in traffic.all)
    assert prometheus.scalar('sum(kvrelay_placements_total{mode="disaggregated"})') == len(traffic.all)
    assert prometheus.scalar("sum(kvrelay_kv_transfer_seconds_count)") == len(traffic.all)
    links = {(r.finish.placement.link, r.finish.placement.transport) for r in traffic.all}
    series = {(s["metric"]["link"], s["metric"]["transport"])
              for s in prometheus.query("kvrelay_kv_transfer_bytes_total")}
    assert series == links, (series, links)
    # the workers' own worker/site/role labels are the targets' (honor_labels keeps them)
    for s in prometheus.query("kvrelay_kv_cache_usage_ratio"):
        m = s["metric"]
        assert m["worker"] == f"local/{m['role']}/0" and m["site"] == "local", m
        assert 0.0 <= float(s["value"][1]) <= 1.0, s


def test_every_exposition_parses_and_passes_promtool(metrics_cluster, traffic):
    for role, text in expositions(metrics_cluster).items():
        names = {f.name for f in text_string_to_metric_families(text)}
        assert FAMILIES[role] <= names, f"{role} lacks {sorted(FAMILIES[role] - names)}"
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 0, f"promtool check metrics on the {role}'s /metrics (rc " \
            f"{check.returncode}):\n{check.stdout}{check.stderr}\n--- exposition ---\n{text}"


def test_no_request_id_is_a_label(metrics_cluster, prometheus, traffic):
    ids = [r.request_id for r in traffic.all]
    assert sorted(ids) == sorted([WARMUP_ID, *REQUEST_IDS])

    def bad(name: str, value: str) -> bool:
        # the workers see "<client id>-<suffix>": no label value may contain a client's id
        return name in ("request_id", "rid", "request") or any(i in value for i in ids)
    for role, text in expositions(metrics_cluster).items():
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                assert not any(bad(k, v) for k, v in s.labels.items()), f"{role}: {s}"
    names = prometheus.api("labels")
    assert "request_id" not in names and "rid" not in names, names
    for name in names:
        values = prometheus.api(f"label/{name}/values")
        assert not any(bad(name, v) for v in values), (name, values)
    # bounded: per family a handful of series (label sets, buckets aside), not one per request
    per_family: dict[str, set] = {}
    for s in prometheus.query('{__name__=~"kvrelay_.+"}'):
        m = dict(s["metric"])
        family = re.sub(r"_(bucket|sum|count)$", "", m.pop("__name__"))
        m.pop("le", None)
        per_family.setdefault(family, set()).add(tuple(sorted(m.items())))
    assert per_family and max(len(v) for v in per_family.values()) < len(ids), per_family


# Panels whose series exist only once something failed, or only between sites (this cluster has one site).
QUIET_WHEN_ALL_GOES_WELL = ("kvrelay_kv_transfer_failures_total", "kvrelay_link_up")


def test_every_dashboard_panel_shows_data_from_a_real_cluster(prometheus, traffic):
    """The Grafana dashboard's queries (template variables as "all"), run by the Prometheus that
    scraped the workload: each one answers with at least one series, except those that only
    have series after a failure or between sites."""
    dash = load_dashboard()
    empty, checked = [], 0
    for expr in exprs(dash):
        if any(name in expr for name in QUIET_WHEN_ALL_GOES_WELL):
            continue
        result = prometheus.api("query", query=substitute(expr))["result"]
        checked += 1
        if not result or all(math.isnan(float(r["value"][1])) for r in result):
            empty.append(expr)
    assert checked >= 20 and not empty, f"{len(empty)} of {checked} panel queries show nothing: {empty}"
