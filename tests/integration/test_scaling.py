"""Per-site pool scaling through the Admin API, with requests streaming:
Montreal's decode pool goes 1 -> 2 -> 1, on local processes (and on a Ray
cluster of two nodes, one per site: test_ray.py). Nothing fails, the new worker takes
placements, the drained one leaves; operators' credentials and bad inputs
are checked."""

from __future__ import annotations

import copy
import re
import signal
import threading
import time

import grpc
import pytest

from kvrelay.cli.main import main
from kvrelay.launch.local import LocalCluster
from kvrelay.router.core.auth import BearerAuth, token_sha256
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import running_cluster, wait_until, workers

pytestmark = pytest.mark.model

CONFIG = {
    "router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
               "liveness": {"heartbeat_interval_s": 0.25}},
    "sites": [{"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 0}},
              {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0},
               "decode": {"replicas": 1, "max_replicas": 2}}],
    "links": [{"between": ["toronto", "montreal"], "rtt_ms": 9, "gbps": 10}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
}
N_REQUESTS, MAX_TOKENS = 16, 16


def _admin(lc: LocalCluster, method: str, request, token: str | None = None):
    token = lc.operator_token if token is None else token
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with lc.dialer().sync(lc.router_address) as ch:
        return getattr(agrpc.AdminStub(ch), method)(request, timeout=30, metadata=md)


def _pool(lc: LocalCluster, site: str, role: str) -> apb.PoolStatus:
    return next(p for p in _admin(lc, "ListPools", apb.ListPoolsRequest()).pools if (p.site, p.role) == (site, role))


class Traffic:
    """Streams N_REQUESTS requests, one every ``gap_s``, each in its own thread.
    The second half waits for ``resume`` to be set: however long a busy machine
    takes to start a new worker, requests still arrive once it is there."""

    def __init__(self, lc: LocalCluster, gap_s: float) -> None:
        self.results: dict[int, tuple[str, int] | str] = {}
        self.lc = lc
        self.gap_s = gap_s
        self.resume = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _one(self, i: int) -> None:
        prompt = [100 + (i * 37 + k) % 5000 for k in range(48)]
        req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, ignore_eos=True)
        try:
            with self.lc.channel() as ch:
                msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=300))
            self.results[i] = (msgs[-1].finish.placement.decode_worker, sum(len(m.token_ids) for m in msgs))
        except grpc.RpcError as exc:
            self.results[i] = f"{exc.code().name}: {exc.details()}"

    def _run(self) -> None:
        threads = []
        for i in range(N_REQUESTS):
            if i == N_REQUESTS // 2:
                self.resume.wait(300)
            t = threading.Thread(target=self._one, args=(i,), daemon=True)
            t.start()
            threads.append(t)
            time.sleep(self.gap_s)
        for t in threads:
            t.join(300)

    def on(self, worker: str) -> int:
        return sum(1 for r in list(self.results.values()) if isinstance(r, tuple) and r[0] == worker)


def scale_up_and_down_while_streaming(lc: LocalCluster) -> str:
    """Montreal decode 1 -> 2 -> 1 under traffic; returns the new worker's name."""
    traffic = Traffic(lc, gap_s=0.25)
    resp = _admin(lc, "Scale", apb.ScaleRequest(site="montreal", role="decode", replicas=2))
    assert resp.pool.desired == 2 and not resp.draining
    try:
        assert wait_until(lambda: _pool(lc, "montreal", "decode").active == 2, 120, 0.5), \
            _pool(lc, "montreal", "decode")
    finally:
        traffic.resume.set()
    new = next(w for w in _pool(lc, "montreal", "decode").workers if w != "montreal/decode/0")
    assert wait_until(lambda: traffic.on(new) >= 2, 120, 0.2), traffic.results  # it takes load
    resp = _admin(lc, "Scale", apb.ScaleRequest(site="montreal", role="decode", replicas=1))
    assert resp.pool.desired == 1 and len(resp.draining) == 1
    drained = resp.draining[0]
    # it leaves: deregistered from the router, its process exits cleanly
    assert wait_until(lambda: drained not in workers(lc), 120, 0.5)
    assert wait_until(lambda: any(c.name == drained for c in lc.left), 30, 0.5)
    assert next(c for c in lc.left if c.name == drained).proc.poll() == 0
    traffic.thread.join(300)
    failed = {i: r for i, r in traffic.results.items() if not isinstance(r, tuple)}
    assert not failed and len(traffic.results) == N_REQUESTS
    assert all(n == MAX_TOKENS for _, n in traffic.results.values())
    pool = _pool(lc, "montreal", "decode")
    assert pool.desired == 1 and pool.active == 1 and pool.draining == 0
    return new


def test_scale_local_processes(plumbing_model):
    with running_cluster(CONFIG, plumbing_model) as lc:
        scale_up_and_down_while_streaming(lc)


@pytest.fixture(scope="module")
def small(plumbing_model):
    with running_cluster(CONFIG, plumbing_model) as lc:
        yield lc


@pytest.mark.parametrize("request_,code,match", [
    (apb.ScaleRequest(site="ottawa", role="decode", replicas=1), "INVALID_ARGUMENT", "unknown site 'ottawa'"),
    (apb.ScaleRequest(site="montreal", role="decode", replicas=-1), "INVALID_ARGUMENT",
     r"replicas must be in \[0, 2\]"),
    (apb.ScaleRequest(site="montreal", role="decode", replicas=3), "INVALID_ARGUMENT", r"max_replicas"),
    (apb.ScaleRequest(site="montreal", role="router", replicas=1), "INVALID_ARGUMENT",
     "role must be prefill or decode"),
])
def test_scale_refuses_bad_requests(small, request_, code, match):
    with pytest.raises(grpc.RpcError) as exc:
        _admin(small, "Scale", request_)
    assert exc.value.code().name == code
    assert re.search(match, exc.value.details())
    assert _pool(small, "montreal", "decode").desired == 1  # nothing changed


@pytest.mark.parametrize("token", ["", "not-the-token"])
def test_admin_needs_operator_credentials(small, token):
    for method, req in (("Scale", apb.ScaleRequest(site="montreal", role="decode", replicas=2)),
                        ("Drain", apb.DrainRequest(worker_id="montreal/decode/0")),
                        ("ListPools", apb.ListPoolsRequest())):
        with pytest.raises(grpc.RpcError) as exc:
            _admin(small, method, req, token=token)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "operator credentials required" in exc.value.details()
    assert _pool(small, "montreal", "decode").desired == 1 and not workers(small)["montreal/decode/0"].draining


def test_drain_unknown_worker(small):
    with pytest.raises(grpc.RpcError) as exc:
        _admin(small, "Drain", apb.DrainRequest(worker_id="montreal/decode/9"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "montreal/decode/9" in exc.value.details()


def test_cli_scale_messages(small, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVRELAY_OPERATOR_TOKEN", raising=False)
    no_token = ["--router", small.router_address, "--ca", str(small.ca_file), "--token-file", str(tmp_path / "none")]
    assert main(["scale", "--site", "montreal", "--role", "decode", "--replicas", "2", *no_token]) == 1
    assert "UNAUTHENTICATED: operator credentials required" in capsys.readouterr().err
    token_file = tmp_path / "token"
    token_file.write_text(small.operator_token + "\n")
    ok = ["--router", small.router_address, "--ca", str(small.ca_file), "--token-file", str(token_file)]
    assert main(["scale", "--site", "montreal", "--role", "decode", "--replicas", "-1", *ok]) == 2
    assert "--replicas must be >= 0" in capsys.readouterr().err
    assert main(["scale", "--site", "ottawa", "--role", "decode", "--replicas", "1", *ok]) == 1
    assert "unknown site 'ottawa'" in capsys.readouterr().err
    assert main(["pools", *ok]) == 0
    out = capsys.readouterr().out
    assert "montreal" in out and "DESIRED" in out
    assert main(["status", *ok]) == 0
    out = capsys.readouterr().out
    assert "DESIRED" in out and "montreal/decode/0" in out and "LINK" in out


def test_plan_recommends_within_limits_and_applies(small, capsys, tmp_path):
    for i in range(3):
        with small.channel() as ch:
            list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
                token_ids=ipb.TokenIds(ids=list(range(200 + i, 260 + i))), max_tokens=4, ignore_eos=True), timeout=120))
    resp = _admin(small, "Plan", apb.PlanRequest())
    plans = {(p.site, p.role): p for p in resp.plans}
    assert set(plans) == {(s, r) for s in ("toronto", "montreal") for r in ("prefill", "decode")}
    assert all(p.reasons for p in resp.plans) and not resp.applied
    assert all(0 <= p.recommended <= 16 for p in resp.plans) and plans[("montreal", "decode")].recommended <= 2
    assert plans[("montreal", "decode")].recommended >= 1  # the cluster keeps a decode worker
    assert _pool(small, "montreal", "decode").desired == 1  # a plan alone changes nothing
    token_file = tmp_path / "token"
    token_file.write_text(small.operator_token)
    assert main(["plan", "--router", small.router_address, "--ca", str(small.ca_file),
                 "--token-file", str(token_file)]) == 0
    assert "RECOMMENDED" in capsys.readouterr().out and _pool(small, "montreal", "decode").desired == 1
    applied = _admin(small, "Plan", apb.PlanRequest(apply=True))
    assert applied.applied
    after = {(p.site, p.role): p.desired for p in _admin(small, "ListPools", apb.ListPoolsRequest()).pools}
    assert after == {(p.site, p.role): p.recommended for p in applied.plans}


def test_launcher_keeps_reconciling_with_configured_operators(tmp_path):
    raw = dict(CONFIG, auth={"operators": [{"name": "noc", "token_sha256": token_sha256("noc-token")}]})
    lc = LocalCluster(parse_config(raw), tmp_path)
    try:
        auth = BearerAuth(lc.cfg.auth.operators, "operator", "auth.operators")
        assert lc.operator_token == ""  # the operators' own tokens are the only ones handed out
        assert auth.who("Bearer noc-token") == "noc"
        assert auth.who(f"Bearer {lc._launcher_token}") == "kvrelay-launcher"
        assert auth.who("Bearer guess") is None
    finally:
        lc._tmp.cleanup()


def test_a_worker_that_does_not_register_within_its_pools_start_timeout_is_replaced(plumbing_model):
    """Montreal's decode pool allows its workers 3 s to register. Scaled to 2, the new worker is
    stopped (SIGSTOP) as it starts, before it can register: the launcher kills it once its pool's
    start_timeout_s has passed and starts another, which registers; Toronto's pool keeps its default."""
    raw = copy.deepcopy(CONFIG)
    raw["sites"][1]["decode"]["start_timeout_s"] = 3.0
    with running_cluster(raw, plumbing_model) as lc:
        assert lc.cfg.sites[0].prefill.start_timeout() == 240.0
        _admin(lc, "Scale", apb.ScaleRequest(site="montreal", role="decode", replicas=2))
        end = time.monotonic() + 60
        child = None
        while child is None and time.monotonic() < end:
            child = next((c for c in lc.children if c.name == "montreal/decode/1"), None)
            time.sleep(0.01)
        assert child is not None, [c.name for c in lc.children]
        child.proc.send_signal(signal.SIGSTOP)  # a start that hangs (a load or compile that never ends)
        stopped_at = time.monotonic()
        assert wait_until(lambda: child.proc.poll() is not None, 60)
        assert child.proc.poll() == -signal.SIGKILL
        assert time.monotonic() - stopped_at >= 2.5  # not before its pool's 3 s (from its start)
        assert "montreal/decode/1" not in workers(lc)
        assert wait_until(lambda: "montreal/decode/2" in workers(lc) and workers(lc)["montreal/decode/2"].healthy, 60)
        assert _pool(lc, "montreal", "decode").desired == 2
