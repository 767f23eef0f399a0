"""The checks on every value a router reads from etcd (router/cluster/shared_values.py) and on the
quota figures (router/core/shared_quotas.py): what passes is exactly what a router writes."""

from __future__ import annotations

import pytest

from kvrelay.cli.main import main
from kvrelay.router.cluster import shared_values as sv
from kvrelay.router.core.shared_quotas import parse_figures
from kvrelay.runtime.config import dump_config, parse_config
from kvrelay.runtime.roles import Role
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

CFG = parse_config({"routers": [{"name": "qc", "site": "montreal"}, {"name": "ont", "site": "toronto"}],
                    "sites": [{"name": "montreal", "jurisdiction": "CA-QC"}, {"name": "toronto",
                                                                              "jurisdiction": "CA-ON"}]})
NAMES = sv.SharedNames.of(CFG)


def peer(**kw) -> bytes:
    fields = {"name": "qc", "site": "montreal", "address": "qc.example:50051", "internal_address": "10.0.0.1:50052",
              "jurisdiction": "CA-QC"} | kw
    return ipb.RouterPeer(**fields).SerializeToString()


def test_a_routers_announcement():
    assert sv.router_peer(NAMES, "qc", peer()).address == "qc.example:50051"
    for name, value, why in [("ghost", peer(name="ghost"), "not one of the config's routers"),
                             ("qc", peer(name="ont"), "it names router 'ont'"),
                             ("qc", peer(site="toronto"), "the config puts it at montreal"),
                             ("qc", peer(address="no port"), "is not host:port"),
                             ("qc", peer(jurisdiction="quebec"), "not a jurisdiction code"),
                             ("qc", b"\xff\xff", "does not parse"),
                             ("qc", b"\x00" * (sv.MAX_VALUE_BYTES + 1), "over the")]:
        with pytest.raises(sv.BadValue, match=why):
            sv.router_peer(NAMES, name, value)


def test_a_workers_record_is_held_to_registers_checks():
    ok = wpb.WorkerInfo(worker_id="montreal/decode/0", site="montreal", role=wpb.ROLE_DECODE, address="h:1")
    assert sv.worker_info(NAMES, "montreal/decode/0", ok.SerializeToString()) == ok
    elsewhere = wpb.WorkerInfo(worker_id="toronto/decode/0", site="montreal", role=wpb.ROLE_DECODE, address="h:1")
    with pytest.raises(sv.BadValue, match="with site 'montreal' and role decode"):
        sv.worker_info(NAMES, "toronto/decode/0", elsewhere.SerializeToString())
    with pytest.raises(sv.BadValue, match="it holds worker 'montreal/decode/0'"):
        sv.worker_info(NAMES, "montreal/decode/1", ok.SerializeToString())
    nowhere = wpb.WorkerInfo(worker_id="atlantis/decode/0", site="atlantis", role=wpb.ROLE_DECODE, address="h:1")
    with pytest.raises(sv.BadValue, match="unknown site 'atlantis'"):
        sv.worker_info(NAMES, "atlantis/decode/0", nowhere.SerializeToString())


def test_drains_and_pool_sizes():
    assert sv.drain("montreal/decode/0", b"") == "montreal/decode/0"
    for name, value in (("nobody", b""), ("montreal/decode/0", b"x"), ("montreal/judge/0", b"")):
        with pytest.raises(sv.BadValue, match="a drain is an empty value"):
            sv.drain(name, value)
    assert sv.pool_size(NAMES, "toronto/prefill", b"3") == (("toronto", Role.PREFILL), 3)
    for name, value in (("atlantis/decode", b"1"), ("toronto/judge", b"1"), ("toronto/decode", b"-1"),
                        ("toronto/decode", b"\xd9\xa3"), ("toronto/decode", b"10000000")):
        with pytest.raises(sv.BadValue):
            sv.pool_size(NAMES, name, value)


def test_quota_figures():
    assert parse_figures(b'{"lab": [1, 2, 0, 3], "x": [0, 0, 0]}') == {"lab": [1, 2, 0, 3], "x": [0, 0, 0]}
    for value in (b"[1, 2]", b"not json", b'{"lab": ["a", 1, 2]}', b'{"lab": [1, 2]}', b'{"lab": [-1, 0, 0]}',
                  b'{"lab": [1, 2, 3, true]}', b'{"lab": [1e300, 0, 0]}'):
        with pytest.raises(sv.BadValue):
            parse_figures(value)


def test_etcd_users_prints_a_user_per_configured_router(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    dump_config(CFG, path)
    assert main(["stores", "etcd-users", "--config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "etcdctl role grant-permission kvrelay-router --prefix=true readwrite '/kvrelay/'" in lines
    assert [x for x in lines if x.startswith("etcdctl user add '")] == [
        "etcdctl user add 'montreal/router/qc' --no-password", "etcdctl user add 'toronto/router/ont' --no-password"]
    assert lines[-1] == "etcdctl auth enable"
