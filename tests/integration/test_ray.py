"""kvrelay on a Ray cluster of two nodes, one per site (the session's `ray_two_sites`: Ray's
start is ~10 s, so its tests share one module): workers and routers run as actors at a node of
their site, a worker's certificate renewals reach it through its actor, and a pool scales
1 -> 2 -> 1 under traffic there. Serial: beside another pytest process Ray's nodes, its object
store and the cluster they run took twice as long (146 s against 68 s alone, session 19)."""

from __future__ import annotations

import shutil
import time

import pytest

from kvrelay.launch.local import LocalCluster
from kvrelay.launch.postgres import installed as postgres_installed
from kvrelay.launch.ray_backend import RayBackend
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import CLUSTER_YAML, running_cluster, wait_until, workers
from tests.integration.test_renewal import PROMPT, _served_at
from tests.integration.test_routers import generate, live_routers, three_routers
from tests.integration.test_scaling import CONFIG, scale_up_and_down_while_streaming

pytestmark = [pytest.mark.model, pytest.mark.serial]
needs_etcd_and_postgres = [
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (make etcd, as root)"),
    pytest.mark.skipif(not postgres_installed(), reason="PostgreSQL is not installed (make postgres, as root)")]


def test_workers_on_ray_nodes_take_renewals_through_their_actors(plumbing_model, ray_two_sites):
    """A worker on a Ray node gets its first certificate in its actor's environment; the actor
    writes it, and each renewal the launcher sends, into a folder of that node's, which the
    worker follows: each then presents its new certificate, and requests still go prefill -> KV
    -> decode, each end checking the other's."""
    raw = dict(CLUSTER_YAML, sites=[
        {"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 0}},
        {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0}, "decode": {"replicas": 1}}])
    with running_cluster(raw, plumbing_model, reconcile=False, backend=RayBackend(["toronto", "montreal"])) as lc:
        remote = {"toronto/prefill/0", "montreal/decode/0"}
        assert {n for n, k in lc.keeper.kept.items() if k.deliver is not None} == remote
        info = {w.info.worker_id: w.info for w in workers(lc).values()}
        assert {n: _served_at(info[n].address, lc) for n in remote} == {n: lc.keeper.kept[n].serial for n in remote}
        assert sorted(lc.keeper.renew_due(now=time.time() + 365 * 86400)) == sorted([*remote, "router"])
        renewed = {n: lc.keeper.kept[n].serial for n in remote}
        assert wait_until(lambda: {n: _served_at(info[n].address, lc) for n in remote} == renewed, 60)
        with lc.client_dialer.sync(lc.router_address) as ch:
            out = [r for r in igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(prompt=PROMPT, max_tokens=8),
                                                                timeout=60) if r.token_ids]
        assert out


@needs_etcd_and_postgres[0]
@needs_etcd_and_postgres[1]
@pytest.mark.slow  # 24 s; in CI: workers as actors at a node of their site (below), routers sharing etcd
# (test_routers.py)
def test_routers_on_ray_each_run_at_a_node_of_its_site(plumbing_model, ray_two_sites):
    """`kvrelay serve --backend ray` with routers: each router is an actor on a node of its own site (as
    workers are), they share etcd and PostgreSQL, and each places on workers the other registered."""
    raw = three_routers()
    raw["routers"] = [{"name": "qc", "site": "montreal"}, {"name": "ont", "site": "toronto"}]
    raw["sites"] = [{"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0},
                     "decode": {"replicas": 1}},
                    {"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 0}, "decode": {"replicas": 0}}]
    nodes = ray_two_sites
    lc = LocalCluster(parse_config(raw), plumbing_model, backend=RayBackend(["montreal", "toronto"]))
    lc.start()
    try:
        on = {c.name: c.proc.node_id() for c in lc.children if c.name.startswith("router/")}
        assert on == {"router/qc": nodes["montreal"].node_id, "router/ont": nodes["toronto"].node_id}
        for name in ("qc", "ont"):  # the decode worker registered with qc (its site's router)
            assert generate(lc, name).placement.decode_worker == "montreal/decode/0"
        assert sorted(live_routers(lc, "ont")) == ["ont", "qc"]
    finally:
        lc.stop()


def test_scale_on_ray_two_nodes(plumbing_model, ray_two_sites):
    nodes = ray_two_sites
    with running_cluster(CONFIG, plumbing_model, backend=RayBackend(["toronto", "montreal"])) as lc:
        def on_right_node() -> bool:
            return all(c.proc.node_id() == nodes[c.site].node_id for c in lc.children if c.role)
        assert on_right_node()
        new = scale_up_and_down_while_streaming(lc)
        assert new.startswith("montreal/decode/")
        assert on_right_node()
