"""A deployment with several routers, without processes: the ``routers:`` and
``etcd:`` config and its errors, how a router process picks its entry
(``--name``), the identities workers admit, a worker's prefix-cache events
shared among routers (a real engine), and the router list a worker follows."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.launch.routers import Ready, router_config
from kvrelay.router.main import announced, named_router, pinned_identity
from kvrelay.runtime.config import ConfigError, parse_config
from kvrelay.runtime.heartbeats import EventFanout, RouterLoops, merge_events
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

SITES = [{"name": "montreal", "jurisdiction": "CA-QC"}, {"name": "toronto", "jurisdiction": "CA-ON"}]
ROUTERS = [{"name": "qc", "site": "montreal", "port": 7001, "internal_port": 7002, "http_port": None},
           {"name": "on", "site": "toronto", "host": "127.0.0.1", "port": 7101}]


def cfg(**more):
    return parse_config({"sites": SITES, "routers": ROUTERS, "postgres": {"endpoints": ["127.0.0.1:5432"]}, **more})


def test_routers_and_their_identities():
    c = cfg(etcd={"endpoints": ["127.0.0.1:2379"]})
    assert c.router_uris == ["kvrelay://montreal/router/qc", "kvrelay://toronto/router/on"]
    assert parse_config({"sites": SITES}).router_uris == ["kvrelay://montreal/router/0"]  # one router, as before


@pytest.mark.parametrize(("more", "error"), [
    ({"routers": [{"name": "qc", "site": "quebec"}]}, "routers[0].site: unknown site 'quebec'"),
    ({"routers": [{"name": "qc", "site": "montreal"}, {"name": "qc", "site": "toronto"}]},
     "routers[1].name: duplicate router 'qc'"),
    ({"routers": [{"name": "Q C", "site": "montreal"}]}, "routers[0].name: 'Q C' must be lowercase"),
    ({"routers": [{"name": "qc"}]}, "routers[0].site: missing"),
    ({"routers": ROUTERS, "tls": {"router_identity": "kvrelay://montreal/router/qc"}},
     "tls.router_identity: with routers: listed"),
    ({"etcd": {"members": 4}}, "etcd.members: must be odd"),
    ({"etcd": {"endpoints": ["https://etcd:2379"]}}, "etcd.endpoints[0]: must be host:port"),
    ({"etcd": {"prefix": "kvrelay"}}, "etcd.prefix: must start and end with /"),
    ({"etcd": {"lease_ttl_s": 1}}, "etcd.lease_ttl_s"),
    ({"etcd": {"watch": True}}, "etcd: unknown field(s) watch"),
    ({"routers": ROUTERS, "etcd": {"endpoints": ["e:2379"], "members": 5}}, "etcd.members: is how many members"),
    ({"etcd": {"endpoints": ["e:2379"]}}, "etcd: set, but routers: lists no routers"),
    ({"postgres": {"endpoints": ["db:5432"]}}, "postgres: set, but routers: lists no routers"),
    ({"routers": ROUTERS, "postgres": {"endpoints": ["db:5432"], "standbys": 2}}, "postgres.standbys: is how many"),
    ({"routers": ROUTERS, "postgres": {"endpoints": ["postgres://db"]}}, "postgres.endpoints[0]: must be host:port"),
    ({"routers": ROUTERS, "postgres": {"user": "Robert'); DROP"}}, "postgres.user: must be a lowercase SQL"),
    ({"routers": ROUTERS, "postgres": {"sslmode": "disable"}}, "postgres: unknown field(s) sslmode"),
    ({"routers": [{"name": "qc", "site": "montreal", "host": "0.0.0.0"}]}, "routers[0].advertise: required when host"),
])
def test_bad_routers_and_etcd_config_is_refused_by_name(more, error):
    with pytest.raises(ConfigError) as exc:
        parse_config({"sites": SITES, **more})
    assert error in str(exc.value)


def test_a_router_process_takes_its_entry():
    c = cfg(etcd={"endpoints": ["127.0.0.1:2379"]})
    mine = named_router(c, "on")
    assert (mine.router.site, mine.router.port, mine.router.internal_port, mine.router.http_port) == \
        ("toronto", 7101, 50052, 8000)
    assert c.router.site is None  # a copy: the loaded config is as it was
    assert pinned_identity(c, "on") == Identity("toronto", CertRole.ROUTER, "on")


@pytest.mark.parametrize(("name", "error"), [
    (None, r"lists routers \(qc, on\): start each with --name"),
    ("bc", "not 'bc'"),
])
def test_a_router_process_without_its_entry_exits_naming_the_problem(name, error):
    with pytest.raises(SystemExit, match=error):
        named_router(cfg(etcd={"endpoints": ["127.0.0.1:2379"]}), name)


def test_several_routers_without_their_jobs_database_exit_naming_it():
    with pytest.raises(SystemExit, match=r"share their batch jobs in PostgreSQL, and postgres\.endpoints is empty"):
        named_router(cfg(etcd={"endpoints": ["127.0.0.1:2379"]}, postgres={}), "qc")


def test_several_routers_without_etcd_refuse_to_start():
    with pytest.raises(SystemExit, match=r"share their state in etcd, and etcd\.endpoints is empty"):
        named_router(cfg(), "qc")
    with pytest.raises(SystemExit, match="lists no routers"):
        named_router(parse_config({"sites": SITES}), "qc")


def test_each_router_on_one_machine_keeps_its_own_records():
    c = cfg()
    c.router.records.jobs_db, c.router.records.audit_log = "/r/jobs.sqlite", "/r/audit/audit.jsonl"
    mine = router_config(c, c.routers[1], Ready("127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"))
    assert (mine.router.records.jobs_db, mine.router.records.audit_log) == ("/r/jobs.on.sqlite",
                                                                           "/r/audit/audit.on.jsonl")
    assert mine.router.records.usage_db is None
    on = mine.router_entry("on")
    assert (on.port, on.internal_port, on.http_port) == (9001, 9002, 9003)  # a restart keeps its ports
    assert Ready.parse("READY 1.2.3.4:5 internal=1.2.3.4:6 metrics=1.2.3.4:7") == \
        Ready("1.2.3.4:5", "1.2.3.4:6", "", "1.2.3.4:7")
    assert Ready.parse("starting") is None


def test_merged_changes_end_as_the_index_would_apply_them():
    share: dict[int, bool] = {}
    merge_events(share, wpb.KVCacheEvents(stored=[1, 2, 3]))
    merge_events(share, wpb.KVCacheEvents(removed=[2, 3], stored=[3]))  # removed then stored, as the index
    merge_events(share, wpb.KVCacheEvents(removed=[1]))
    assert share == {1: False, 2: False, 3: True}


def test_every_router_gets_every_prefix_cache_change(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"], block_size=4)

    async def run():
        aeng = AsyncEngine(eng)
        await aeng.start()
        try:
            fan = EventFanout(aeng)
            assert (await fan.take("a", True)).snapshot  # each router's first heartbeat: a snapshot
            assert (await fan.take("b", True)).stored == []
            async for _ in aeng.generate("r1", list(range(10, 22)), SamplingParams(max_tokens=1)):
                pass
            first_a = await fan.take("a", False)  # drains the engine: b's share keeps the same changes
            assert len(first_a.stored) == 3 and not first_a.snapshot
            async for _ in aeng.generate("r2", list(range(40, 52)), SamplingParams(max_tokens=1)):
                pass
            b = await fan.take("b", False)
            assert set(b.stored) == set(first_a.stored) | set((await fan.take("a", False)).stored)
            assert len(b.stored) == 6
            full = await fan.take("c", True)  # a snapshot for a newcomer leaves the others' shares alone
            assert set(full.stored) == set(b.stored) and full.snapshot
            fan.forget("c")
            assert set(fan.pending) == {"a", "b"}
        finally:
            await aeng.stop()

    asyncio.run(run())


def test_a_worker_follows_only_the_routers_its_deployment_lists():
    loops = RouterLoops(frozenset({"kvrelay://montreal/router/qc", "kvrelay://toronto/router/on"}))
    qc = ipb.RouterPeer(name="qc", site="montreal", internal_address="10.0.0.1:50052")
    on = ipb.RouterPeer(name="on", site="toronto", internal_address="10.0.0.2:50052")
    stranger = ipb.RouterPeer(name="evil", site="toronto", internal_address="10.0.0.9:50052")
    loops.update([qc, on, stranger])
    assert set(loops.peers) == {"10.0.0.1:50052", "10.0.0.2:50052"} and loops.changed.is_set()
    loops.changed.clear()
    loops.update([qc, on])
    assert not loops.changed.is_set()  # the same routers: nothing to start or stop
    loops.update([])  # an answer without a list (a router that has none yet) changes nothing
    assert len(loops.peers) == 2
    loops.update([qc])
    assert set(loops.peers) == {"10.0.0.1:50052"} and loops.changed.is_set()


def test_a_router_announces_the_address_the_others_reach_it_by():
    c = parse_config({"sites": SITES, "etcd": {"endpoints": ["127.0.0.1:2379"]},
                      "postgres": {"endpoints": ["db.example.org:5432"]}, "routers": [
        {"name": "qc", "site": "montreal", "host": "0.0.0.0", "advertise": "router.qc.example.org"},
        {"name": "ont", "site": "toronto", "host": "10.1.2.3"}]})
    qc = announced(named_router(c, "qc"), "qc", "0.0.0.0:50051", "0.0.0.0:50052", "0.0.0.0:8000")
    assert (qc.address, qc.internal_address, qc.http_address) == (
        "router.qc.example.org:50051", "router.qc.example.org:50052", "router.qc.example.org:8000")
    ont = announced(named_router(c, "ont"), "ont", "10.1.2.3:50051", "10.1.2.3:50052", "")
    assert (ont.address, ont.http_address, ont.site) == ("10.1.2.3:50051", "", "toronto")
    assert c.routers[1].reachable("10.1.2.3:7") == "10.1.2.3:7"
