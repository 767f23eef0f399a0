"""Tenant policy at the router, without processes: the config's rules,
jurisdictions narrowed and never widened, max_context, token-bucket quotas
(with a fake clock), prefix-cache sharing groups, dedicated pools in
placement, and the fair queue's order under contention."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.router.cluster.shared_values import BadValue
from kvrelay.router.core.admission import PUMP_TRIES, FairQueue
from kvrelay.router.core.auth import TenantSalts
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.jobs_store import JobStore, StoredLimits, StoreLimitExceeded
from kvrelay.router.core.quotas import QuotaExceeded, Quotas
from kvrelay.router.core.shared_quotas import QuotaExchange
from kvrelay.router.core.tenancy import TenantPolicies
from kvrelay.router.placement.place import (
    ClusterView,
    LinkView,
    PlacementError,
    PlacementFailure,
    PlacementRequest,
    Wait,
    WorkerView,
    make_policy,
    place,
)
from kvrelay.runtime.config import ConfigError, parse_config
from kvrelay.runtime.roles import Role
from kvrelay.runtime.tenants import TenantSection

SITES = [{"name": "montreal", "jurisdiction": "CA-QC"}, {"name": "toronto", "jurisdiction": "CA-ON"}]


def _cfg(tenants, sites=SITES):
    return parse_config({"sites": sites, "tenants": tenants})


@pytest.mark.parametrize("tenants, sites, message", [
    ([{"name": "a", "jurisdictions": ["FR"]}], SITES, "tenants[0].jurisdictions: no site is in 'FR'"),
    ([{"name": "a"}, {"name": "a"}], SITES, "duplicate tenant 'a'"),
    ([{"name": "a", "token_sha256": "a" * 64}, {"name": "b", "token_sha256": "a" * 64}], SITES,
     "the same token as tenant 'a'"),
    ([{"name": "a", "share_prefix_cache_with": ["b"]}, {"name": "b"}], SITES, "a sharing group must list each other"),
    ([{"name": "a", "share_prefix_cache_with": ["z"]}], SITES, "'z' is not another tenant"),
    ([{"name": "a", "priority": "urgent"}], SITES, "tenants[0].priority: must be one of high, normal, low"),
    ([{"name": "a", "requests_per_minute": 0}], SITES, "tenants[0].requests_per_minute: must be >= 1"),
    ([{"name": "a", "weight": -1}], SITES, "tenants[0].weight: must be >= 1e-06"),
    ([{"name": "a", "colour": "red"}], SITES, "tenants[0]: unknown field(s) colour"),
    ([{"name": "a", "max_stored_jobs": 0}], SITES, "tenants[0].max_stored_jobs: must be >= 1"),
    ([{"name": "a", "max_stored_job_bytes": "1G"}], SITES, "tenants[0].max_stored_job_bytes"),
    ([{"name": "a"}], [{"name": "x", "decode": {"tenants": ["b"]}}], "sites[0].decode.tenants: 'b' is not a tenant"),
])
def test_the_config_refuses_inconsistent_tenants(tenants, sites, message):
    with pytest.raises(ConfigError) as err:
        _cfg(tenants, sites)
    assert message in str(err.value)


def test_auth_clients_is_refused_with_where_it_went():
    with pytest.raises(ConfigError, match="moved to the top-level tenants"):
        parse_config({"auth": {"clients": [{"name": "a", "token_sha256": "a" * 64}]}})


def test_a_request_narrows_its_tenants_jurisdictions_and_never_widens_them():
    pol = TenantPolicies(_cfg([{"name": "lab-qc", "jurisdictions": ["CA-QC"]}, {"name": "free"}]))
    assert pol.jurisdictions("lab-qc", None) == {"CA-QC"}
    assert pol.jurisdictions("lab-qc", frozenset({"CA-QC", "CA-ON"})) == {"CA-QC"}
    assert pol.jurisdictions("free", frozenset({"CA-ON"})) == {"CA-ON"} and pol.jurisdictions("free", None) is None
    with pytest.raises(RouterError) as err:
        pol.jurisdictions("lab-qc", frozenset({"CA-ON"}))
    assert err.value.kind is ErrorKind.CONSTRAINT
    assert "{CA-ON}" in err.value.message and "{CA-QC}" in err.value.message  # both sets named


def test_max_context_is_a_clear_refusal():
    pol = TenantPolicies(_cfg([{"name": "a", "max_context": 100}]))
    pol.check_context("a", 60, 40)
    with pytest.raises(RouterError) as err:
        pol.check_context("a", 60, 41)
    assert err.value.kind is ErrorKind.INVALID and "max_context quota is 100" in err.value.message


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_requests_per_minute_is_a_token_bucket():
    clock = Clock()
    q, a = Quotas(clock), TenantSection("a", requests_per_minute=6)
    grants = [q.admit(a, 10) for _ in range(6)]
    with pytest.raises(RouterError) as err:
        q.admit(a, 10)
    assert err.value.kind is ErrorKind.OVERLOADED and "requests_per_minute quota (6)" in err.value.message
    assert err.value.retry_after_s == pytest.approx(10.0, abs=0.01)  # one request refills every 10 s
    for g in grants:
        q.release(g, 10)
    clock.t += 10.0
    q.admit(a, 10)
    with pytest.raises(RouterError):
        q.admit(a, 10)
    assert q.admit(TenantSection("b"), 10) is not None  # no quota, no limit


def test_tokens_per_minute_returns_what_was_not_generated():
    clock = Clock()
    q, a = Quotas(clock), TenantSection("a", tokens_per_minute=1000)
    g = q.admit(a, 800)  # prompt + max_tokens held
    with pytest.raises(RouterError) as err:
        q.admit(a, 300)
    assert "tokens_per_minute quota (1000" in err.value.message
    q.release(g, 300)  # only 300 used: 500 come back
    q.admit(a, 300)
    big = Quotas(clock)
    big.admit(a, 5000)  # larger than the bucket: let through when it is full, leaving it in debt
    with pytest.raises(RouterError):
        big.admit(a, 1)


def test_the_routers_exchange_what_they_took_of_a_quota():
    """Two routers' Quotas, joined by QuotaExchange.apply as etcd would carry their figures."""
    cfg = parse_config({"sites": [{"name": "s"}], "tenants": [
        {"name": "a", "token_sha256": "0" * 64, "requests_per_minute": 6, "tokens_per_minute": 1000,
         "max_concurrent": 3}]})
    tenants, clock = TenantPolicies(cfg), Clock()
    here, there = Quotas(clock), Quotas(clock)
    ex = QuotaExchange(None, "/k/", "here", here, tenants, lambda: 0)  # type: ignore[arg-type]  # no etcd: apply only
    a = tenants.of("a")
    g = there.admit(a, 100)
    ex.apply({"there": json.loads(_figures(there))})  # first sight: its past is not charged
    for _ in range(4):
        there.release(there.admit(a, 100), 50)
    ex.apply({"there": json.loads(_figures(there)), "junk": {"nobody": [9, 9, 9]}})  # unknown tenants ignored
    assert here.state["a"].requests.level == pytest.approx(2.0)  # 6 - the 4 taken there since
    assert here.state["a"].tokens.level == pytest.approx(1000 - 4 * 50)  # net of what came back
    assert here.state["a"].remote_running == 1  # g still runs there
    here.admit(a, 10)
    here.admit(a, 10)
    with pytest.raises(QuotaExceeded, match="max_concurrent quota"):
        here.admit(a, 10)  # 2 here + 1 there
    ex.apply({})  # that router left (its lease ended): its request no longer counts
    assert here.state["a"].remote_running == 0
    ex.take("there", _figures(there).encode())  # as the membership watch hands them over
    ex.take("here", b"{}")  # this router's own key: not another's
    with pytest.raises(BadValue, match="not a JSON object"):  # not figures: not taken (the membership audits it)
        ex.take("junk", b"[1, 2]")
    assert set(ex.latest) == {"there"} and ex.latest["there"]["a"][0] == 5
    ex.take("there", None)  # its lease ended
    assert ex.latest == {}
    there.release(g, 100)


def _figures(q: Quotas) -> str:
    return QuotaExchange(None, "/k/", "x", q, None, lambda: 0).mine().decode()  # type: ignore[arg-type]


def test_max_concurrent_counts_requests_in_progress():
    q, a = Quotas(Clock()), TenantSection("a", max_concurrent=2)
    g1, _ = q.admit(a, 1), q.admit(a, 1)
    with pytest.raises(RouterError, match="max_concurrent quota"):
        q.admit(a, 1)
    q.release(g1, 1)
    q.release(g1, 1)  # twice changes nothing
    q.admit(a, 1)
    with pytest.raises(RouterError):
        q.admit(a, 1)


def test_a_quota_refusal_says_whose_quota_it_is():
    q, a = Quotas(Clock()), TenantSection("a", requests_per_minute=1)
    q.admit(a, 1)
    with pytest.raises(QuotaExceeded) as err:  # the job runner pauses only this tenant's jobs on it
        q.admit(a, 1)
    assert err.value.tenant == "a" and err.value.kind is ErrorKind.OVERLOADED


def test_tenants_with_pending_jobs_take_turns(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    store.submit("huge", [b"a"] * 50, owner="lab-a")  # the oldest job, far larger than the others
    store.submit("small", [b"b"] * 3, owner="lab-b")
    store.submit("tiny", [b"c"] * 2, owner="lab-c")
    first = [owner for *_, owner in store.claim(6)]
    assert sorted(first) == ["lab-a", "lab-a", "lab-b", "lab-b", "lab-c", "lab-c"]
    assert [owner for *_, owner in store.claim(4, frozenset({"lab-a"}))] == ["lab-b"]  # lab-a paused (over quota)
    store.close()


def test_the_store_holds_a_tenant_to_its_stored_jobs_and_bytes(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    limits = StoredLimits(jobs=2, bytes=100)
    a = store.submit("a", [b"x" * 30], owner="lab-a", limits=limits)
    (job, idx, _, _), = store.claim(1)
    store.finish(job, idx, b"r" * 20, True)  # a stored result counts too
    assert store.holdings("lab-a") == (1, 50) and store.get(a.id).bytes == 50
    with pytest.raises(StoreLimitExceeded, match="stores 50 bytes of jobs and this one is 60: over its "
                                                 "max_stored_job_bytes quota \\(100\\)"):
        store.submit("b", [b"y" * 60], owner="lab-a", limits=limits)
    store.submit("b", [b"y" * 40], owner="lab-a", limits=limits)
    with pytest.raises(StoreLimitExceeded, match="stores 2 jobs, its max_stored_jobs quota"):
        store.submit("c", [b"z"], owner="lab-a", limits=limits)
    assert store.submit("c", [b"z"], owner="lab-b", limits=limits).total == 1  # another tenant's own count
    assert [r.name for r in store.list("lab-a")] == ["a", "b"]  # nothing of a refused job was stored
    store.delete(a.id)
    assert store.holdings("lab-a") == (1, 40)
    store.close()


def test_a_database_from_before_stored_bytes_gets_them_counted(tmp_path):
    import sqlite3
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, state INTEGER NOT NULL, total INTEGER NOT NULL,
                           created REAL NOT NULL, finished REAL NOT NULL DEFAULT 0, owner TEXT NOT NULL DEFAULT '');
        CREATE TABLE items (job TEXT NOT NULL, idx INTEGER NOT NULL, request BLOB NOT NULL, status INTEGER NOT NULL,
                            result BLOB, seq INTEGER, PRIMARY KEY (job, idx));
        INSERT INTO jobs VALUES ('j1', 'old', 3, 2, 1.0, 2.0, 'lab-a');
        INSERT INTO items VALUES ('j1', 0, X'0102030405', 2, X'0a0b', 1), ('j1', 1, X'01', 2, NULL, NULL);""")
    db.commit()
    db.close()
    store = JobStore(path)
    assert store.holdings("lab-a") == (1, 8)  # 5 + 2 bytes of the first request, 1 of the second
    store.close()


def test_a_job_submission_takes_one_request_of_the_quota():
    t = [0.0]
    q = Quotas(clock=lambda: t[0])
    policy = TenantSection(name="a", requests_per_minute=2)
    assert q.take_submission(policy) is None and q.take_submission(policy) is None
    over = q.take_submission(policy)
    assert isinstance(over, QuotaExceeded) and "a job submission counts as one request" in over.message
    assert q.refusal(policy, 1) is not None  # the submissions took the interactive requests' room too
    t[0] += 30.0  # a minute's 2 refill at one per 30 s
    assert q.take_submission(policy) is None
    assert q.take_submission(TenantSection(name="b")) is None  # no quota: never refused


def test_prefix_cache_sharing_needs_both_sides():
    cfg = _cfg([{"name": "a", "share_prefix_cache_with": ["b"]}, {"name": "b", "share_prefix_cache_with": ["a"]},
                {"name": "c"}])
    salts = TenantSalts(b"k" * 32, cfg.tenants)
    assert salts.of("a") == salts.of("b") != salts.of("c")
    assert TenantSalts(b"k" * 32).of("c") == salts.of("c")  # a tenant alone keeps its own domain


def _view(dedicated: frozenset[str]) -> ClusterView:
    workers = [WorkerView("mtl/decode/0", Role.DECODE, "mtl", tenants=dedicated),
               WorkerView("tor/decode/0", Role.DECODE, "tor")]
    return ClusterView(workers, {"mtl": "CA-QC", "tor": "CA-ON"}, {frozenset({"mtl", "tor"}): LinkView(9, 1)})


def test_a_dedicated_pool_serves_only_its_tenants():
    policy = make_policy("least_loaded", 1)
    view = _view(frozenset({"lab-on"}))
    for _ in range(10):
        assert place(PlacementRequest(8, tenant="lab-qc"), view, policy).decode.site == "tor"
    assert {place(PlacementRequest(8, tenant="lab-on"), view, policy).decode.site for _ in range(10)} == {"mtl", "tor"}
    with pytest.raises(PlacementError) as err:  # lab-qc may only use Montreal, whose pool is lab-on's
        place(PlacementRequest(8, allowed_jurisdictions=frozenset({"CA-QC"}), tenant="lab-qc"), view, policy)
    assert err.value.kind is PlacementFailure.CONSTRAINT


class Slots:
    """Capacity for the fair queue's tests: ``n`` free slots; a placement takes one."""

    def __init__(self) -> None:
        self.free = 0
        self.served: list[str] = []

    def placer(self, name: str):
        def try_place():
            if self.free <= 0:
                raise PlacementError(PlacementFailure.CAPACITY, "full", 1.0, Wait.ROOM)
            self.free -= 1
            self.served.append(name)
            return name
        return try_place


def _drain(q: FairQueue, slots: Slots, n: int) -> None:
    for _ in range(n):
        slots.free = 1
        q.pump()


def test_a_flooding_tenant_delays_only_itself():
    async def go():
        q, slots = FairQueue(), Slots()
        for i in range(20):
            q.ticket("a", 1, False, 1.0, 100, "any", slots.placer(f"a{i}"))  # a batch job's backlog
        q.ticket("b", 1, True, 1.0, 100, "any", slots.placer("b-interactive"))
        _drain(q, slots, 3)
        return slots.served

    assert asyncio.run(go())[0] == "b-interactive"


def test_tenants_share_by_weight_and_classes_go_in_order():
    async def go():
        q, slots = FairQueue(), Slots()
        for _i in range(30):
            q.ticket("heavy", 1, True, 3.0, 100, "any", slots.placer("heavy"))
            q.ticket("light", 1, True, 1.0, 100, "any", slots.placer("light"))
        _drain(q, slots, 20)
        first = list(slots.served)
        q.ticket("vip", 0, True, 1.0, 100, "any", slots.placer("vip"))  # a higher class
        _drain(q, slots, 1)
        return first, slots.served[-1]

    first, last = asyncio.run(go())
    assert first.count("heavy") == 15 and first.count("light") == 5  # 3:1, as the weights
    assert last == "vip"


def test_weights_hold_across_routers():
    """Equal weights, both tenants backlogged here; another router is serving "a" too (its admitted tokens
    arrive through the quota exchange): here "b" gets the larger share, so over both routers they are even."""
    async def go():
        q, slots = FairQueue(), Slots()
        for _i in range(20):
            q.ticket("a", 1, True, 1.0, 100, "any", slots.placer("a"))
            q.ticket("b", 1, True, 1.0, 100, "any", slots.placer("b"))
        q.served_elsewhere("a", 600, 1.0)  # six of a's requests ran at the other router meanwhile
        q.served_elsewhere("nobody", 600, 1.0)  # a tenant with nothing waiting here: no debt, no effect
        _drain(q, slots, 12)
        return slots.served

    served = asyncio.run(go())
    assert served.count("b") == 9 and served.count("a") == 3  # 9 here + 0 there = 3 here + 6 there


def test_a_waiter_that_does_not_fit_does_not_block_others():
    async def go():
        q, slots = FairQueue(), Slots()

        def never():
            raise PlacementError(PlacementFailure.CAPACITY, "its site is full", 1.0, Wait.ROOM)
        stuck = q.ticket("a", 1, True, 1.0, 1, "montreal", never)
        other = q.ticket("b", 1, True, 1.0, 1, "anywhere", slots.placer("b"))
        _drain(q, slots, 1)
        return stuck.future.done(), other.future.result()

    assert asyncio.run(go()) == (False, "b")


def test_requests_that_gave_up_waiting_leave_their_tenant_no_debt():
    async def go():
        q, slots = FairQueue(), Slots()
        for i in range(10):  # an outage: every one of them gives up waiting
            q.withdraw(q.ticket("a", 1, True, 1.0, 100, "any", slots.placer(f"gone{i}")))
        for i in range(3):
            q.ticket("b", 1, True, 1.0, 100, "any", slots.placer(f"b{i}"))
        q.ticket("a", 1, True, 1.0, 100, "any", slots.placer("a"))
        _drain(q, slots, 4)
        return slots.served

    assert asyncio.run(go()) == ["b0", "a", "b1", "b2"]


def test_a_long_pass_over_the_queue_lets_the_event_loop_run():
    """A pass over 40 waiting tickets that all fit tries PUMP_TRIES of them,
    lets the event loop run, and carries on where it stopped, in order."""
    async def go():
        q, slots = FairQueue(), Slots()
        tickets = [q.ticket("a", 1, True, 1.0, 1, f"site{i}", slots.placer(f"t{i}")) for i in range(40)]
        for _ in range(20):  # the passes those tickets started (none finds room) end
            await asyncio.sleep(0)
        slots.free = 40
        q.pump()
        in_one_turn = sum(t.future.done() for t in tickets)
        turns = 0
        while not all(t.future.done() for t in tickets) and turns < 100:
            await asyncio.sleep(0)
            turns += 1
        return in_one_turn, turns, slots.served

    in_one_turn, turns, served = asyncio.run(go())
    assert in_one_turn == PUMP_TRIES and turns >= 40 // PUMP_TRIES - 1
    assert served == [f"t{i}" for i in range(40)]


@pytest.mark.parametrize("tenants, sites, message", [
    ([{"name": "anonymous", "token_sha256": "a" * 64}], SITES, "tenant 'anonymous' is the one of callers without"),
    ([{"name": "a", "weight": 1e-310}], SITES, "tenants[0].weight: must be >= 1e-06"),
    ([{"name": "qc", "jurisdictions": ["CA-QC"]}],
     [SITES[0], {"name": "toronto", "jurisdiction": "CA-ON", "decode": {"tenants": ["qc"]}}],
     "sites[1].decode.tenants: the pool is in CA-ON, where none of qc may be served"),
])
def test_the_config_refuses_policies_that_cannot_work(tenants, sites, message):
    with pytest.raises(ConfigError) as err:
        _cfg(tenants, sites)
    assert message in str(err.value)
