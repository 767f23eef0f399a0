"""A router in every emulated city (`kvrelay serve --cities` with `routers:`): each router runs in
its city's network namespace, bound to the city's address (clients reach it from the root namespace;
it reaches other cities' workers over the emulated links), and the routers share etcd and PostgreSQL
listening on the cities' bridge. Needs root, iproute2, /dev/net/tun, etcd and PostgreSQL."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvrelay.launch import cities
from kvrelay.launch.local import LocalCluster
from kvrelay.launch.postgres import installed as postgres_installed
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import wait_until, workers

PREFIX, SUBNET = "kvtr", "10.217.0.0/16"
CONFIG = {
    "router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
               "liveness": {"heartbeat_interval_s": 0.25, "link_probe_timeout_s": 1.0}},
    "routers": [{"name": "ont", "site": "toronto"}, {"name": "qc", "site": "montreal"}],
    "etcd": {"lease_ttl_s": 2},
    "sites": [{"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 0}},
              {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0}, "decode": {"replicas": 1}}],
    "links": [{"between": ["toronto", "montreal"], "rtt_ms": 10.0, "gbps": 1.0, "transport": "tcp"}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
}

pytestmark = [
    pytest.mark.serial,  # the emulated links carry the routers' calls: measured alone
    pytest.mark.skipif(os.geteuid() != 0 or not Path("/dev/net/tun").exists() or not shutil.which("tc"),
                       reason="WAN emulation needs root, /dev/net/tun and iproute2's tc"),
    pytest.mark.skipif(shutil.which("etcd") is None or not postgres_installed(),
                       reason="several routers need etcd and PostgreSQL (make etcd postgres, as root)"),
]


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino



# 26 s alone; in CI: routers sharing etcd and PostgreSQL on loopback (test_routers.py), and workers in the
# emulated cities reached over their links (test_cities.py)
@pytest.mark.slow
def test_a_router_in_every_city_in_its_namespace(tmp_path, plumbing_model):
    for ns in (f"{PREFIX}-toronto", f"{PREFIX}-montreal"):  # what an interrupted run left
        if Path(f"/run/netns/{ns}").exists():
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
    cfg = parse_config(CONFIG)
    st = cities.up(cfg, tmp_path / "state", SUBNET, PREFIX)
    try:
        lc = LocalCluster(cfg, plumbing_model, cities=st)
        lc.start()
        try:
            for name, site in (("ont", "toronto"), ("qc", "montreal")):
                router = next(c for c in lc.children if c.name == f"router/{name}")
                assert _netns_inode(router.proc.pid) == os.stat(f"/run/netns/{PREFIX}-{site}").st_ino
                assert lc.routers[name].address.startswith(st.site(site).site_addr + ":")  # the city's address
            assert wait_until(lambda: all(w.healthy for w in workers(lc).values()) and len(workers(lc)) == 2, 60)
            for name in ("ont", "qc"):  # from the root namespace, each router places across the link
                with lc.client_dialer.sync(lc.routers[name].address) as ch:
                    msgs = list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
                        token_ids=ipb.TokenIds(ids=list(range(100, 140))), max_tokens=3, ignore_eos=True),
                        timeout=120))
                pl = msgs[-1].finish.placement
                assert (pl.prefill_site, pl.decode_site) == ("toronto", "montreal"), (name, pl)
                assert sum(len(m.token_ids) for m in msgs) == 3
            with lc.dialer().sync(lc.routers["qc"].address) as ch:
                listed = igrpc.InferenceStub(ch).ListRouters(ipb.ListRoutersRequest(), timeout=10)
            assert sorted(r.name for r in listed.routers) == ["ont", "qc"]
            assert lc.etcd is not None and all(e.startswith(st.gateway + ":") for e in lc.etcd.endpoints)
        finally:
            lc.stop()
    finally:
        assert cities.down(tmp_path / "state") == []
