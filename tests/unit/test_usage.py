"""Usage accounting without processes: the worker's meter on a real engine
(each step's time split among tenants by the tokens they computed), the
router's ledger on a real SQLite file (deltas between heartbeats, exactly
once across a router restart, from zero after a worker restart, grouping,
minutes, a failed write kept), and `kvrelay usage`'s time arguments."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest

from kvrelay.cli.usage import parse_since
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.router.cluster.usage import UsageLedger, UsageNames, grouping, usage_response
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.usage_meter import UsageKey, UsageMeter, kv_link, split_ns
from kvrelay.v1 import worker_pb2 as wpb

A, B = UsageKey("lab-a", "toronto-montreal"), UsageKey("lab-b", "")


# -- the worker's meter ------------------------------------------------------------------------------------------
def test_split_ns_is_proportional_and_adds_up_exactly():
    parts = split_ns(1_000_003, {A: 1, B: 2})
    assert sum(parts.values()) == 1_000_003
    assert parts[A] == 333_334 and parts[B] == 666_669
    assert split_ns(0, {A: 1}) == {} and split_ns(10, {}) == {}


def test_kv_link_names_the_link_to_the_receivers_site():
    assert kv_link("toronto", "montreal/decode/0") == "montreal-toronto"
    assert kv_link("toronto", "toronto/decode/3") == "local"
    assert kv_link("toronto", "") == ""


def test_meter_shares_every_step_by_tokens_on_a_real_engine(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"], max_batched=64)
    meter = UsageMeter()
    steps = []

    def hook(step):
        steps.append(step)
        meter.on_step(step)
    eng.step_hook = hook
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.add_request("a", list(range(10, 110)), params, account=A)  # 100 prompt tokens: two chunks of 64 + 36
    eng.add_request("b", list(range(120, 140)), params, account=B)
    eng.add_request("x", list(range(150, 155)), params)  # no account
    done = set()
    while len(done) < 3:
        done |= {o.request_id for o in eng.step() if o.finished}
    got = meter.snapshot()
    assert sum(c.engine_ns for c in got.values()) == sum(s.ns for s in steps)
    tokens = {}
    for s in steps:
        for account, n in s.tokens:
            tokens[account] = tokens.get(account, 0) + n
    assert tokens == {A: 100 + 3, B: 20 + 3, None: 5 + 3}  # prompt + 3 decode steps (the 4th token: sampled)
    first = steps[0]  # A's first chunk fills the 64-token budget alone
    assert first.tokens == [(A, 64)]
    assert got[A].engine_ns > got[B].engine_ns
    assert got[UsageKey("", "")].engine_ns > 0


def test_meter_protos_carry_every_counter_and_the_incarnation():
    meter = UsageMeter()
    meter.count(A, prompt_tokens=90, cached_tokens=10)
    meter.count(B, requests=1, completion_tokens=4, kv_bytes=4096)
    meter.count(B, completion_tokens=1)
    rows = {(u.tenant, u.link): u for u in meter.protos()}
    assert rows[("lab-a", "toronto-montreal")].prompt_tokens == 90
    assert rows[("lab-b", "")].completion_tokens == 5 and rows[("lab-b", "")].kv_bytes == 4096
    assert len(meter.incarnation) == 16 and UsageMeter().incarnation != meter.incarnation


# -- the router's ledger -----------------------------------------------------------------------------------------
class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def load(worker: str, incarnation: str, **per_key) -> wpb.WorkerLoad:
    """A heartbeat's load; keywords ``tenant__link=(requests, prompt, completion, cached, kv_bytes, engine_ns)``."""
    usage = []
    for name, c in per_key.items():
        tenant, _, link = name.partition("__")
        usage.append(wpb.TenantUsage(tenant=tenant.replace("_", "-"), link=link.replace("_", "-"),
                                     requests=c[0], prompt_tokens=c[1], completion_tokens=c[2], cached_tokens=c[3],
                                     kv_bytes=c[4], engine_ns=c[5]))
    return wpb.WorkerLoad(worker_id=worker, incarnation=incarnation, usage=usage)


def totals(ledger: UsageLedger, **kw) -> dict[tuple, tuple]:
    rep = ledger.query(**kw)
    return {(r.tenant, r.site, r.link, r.role, r.worker): (r.requests, r.prompt_tokens, r.completion_tokens,
                                                            r.cached_tokens, r.kv_bytes, r.prefill_worker_s,
                                                            r.decode_worker_s) for r in rep.rows}


ALL = ("tenant", "site", "link", "role", "worker")


def test_heartbeats_become_deltas_grouped_as_asked(tmp_path):
    led = UsageLedger(str(tmp_path / "u.sqlite"), Clock())
    d, p = "montreal/decode/0", "toronto/prefill/0"
    led.observe(d, "montreal", "decode", load(d, "i1", lab_a__montreal_toronto=(1, 0, 4, 0, 1000, 2_000_000_000)))
    led.observe(d, "montreal", "decode", load(d, "i1", lab_a__montreal_toronto=(3, 0, 12, 0, 3000, 5_000_000_000),
                                              lab_b__=(1, 20, 4, 16, 0, 1_000_000_000)))
    led.observe(p, "toronto", "prefill", load(p, "j1", lab_a__montreal_toronto=(0, 600, 0, 32, 0, 4_000_000_000)))
    got = totals(led, by=ALL)
    assert got == {("lab-a", "montreal", "montreal-toronto", "decode", d): (3, 0, 12, 0, 3000, 0.0, 5.0),
                   ("lab-b", "montreal", "", "decode", d): (1, 20, 4, 16, 0, 0.0, 1.0),
                   ("lab-a", "toronto", "montreal-toronto", "prefill", p): (0, 600, 0, 32, 0, 4.0, 0.0)}
    by_tenant = totals(led, by=["tenant"])
    assert by_tenant[("lab-a", "", "", "", "")] == (3, 600, 12, 32, 3000, 4.0, 5.0)
    assert set(totals(led, tenant="lab-b")) == {("lab-b", "montreal", "", "", "")}  # default: tenant, site, link
    resp = usage_response(led.query(by=["link"]))
    assert sorted(r.link for r in resp.rows) == ["", "montreal-toronto"]


def test_a_router_restart_neither_loses_nor_double_counts(tmp_path):
    path, clock, d = str(tmp_path / "u.sqlite"), Clock(), "local/decode/0"
    led = UsageLedger(path, clock)
    led.observe(d, "local", "decode", load(d, "i1", lab_a__=(1, 10, 4, 0, 0, 100)))
    assert led.flush()
    led.observe(d, "local", "decode", load(d, "i1", lab_a__=(2, 20, 8, 0, 0, 200)))  # never written: the router dies
    led.db.close()
    again = UsageLedger(path, clock)
    again.observe(d, "local", "decode", load(d, "i1", lab_a__=(2, 20, 8, 0, 0, 200)))  # the same reading again
    assert totals(again, by=["tenant"])[("lab-a", "", "", "", "")][:5] == (2, 20, 8, 0, 0)
    again.db.close()
    third = UsageLedger(path, clock)
    third.observe(d, "local", "decode", load(d, "i1", lab_a__=(2, 20, 8, 0, 0, 200)))  # and once more
    third.observe(d, "local", "decode", load(d, "i1", lab_a__=(3, 30, 12, 0, 0, 300)))
    assert totals(third, by=["tenant"])[("lab-a", "", "", "", "")][:5] == (3, 30, 12, 0, 0)


def test_a_worker_restart_counts_from_zero(tmp_path):
    led, d = UsageLedger(str(tmp_path / "u.sqlite"), Clock()), "local/decode/0"
    led.observe(d, "local", "decode", load(d, "i1", lab_a__=(5, 50, 20, 0, 0, 0)))
    led.observe(d, "local", "decode", load(d, "i2", lab_a__=(1, 10, 4, 0, 0, 0)))  # new process, same id
    assert totals(led, by=["tenant"])[("lab-a", "", "", "", "")][:3] == (6, 60, 24)


def test_rows_are_per_minute_and_since_filters_them(tmp_path):
    clock, d = Clock(1_800_000_000.0), "local/decode/0"  # a minute's start
    led = UsageLedger(str(tmp_path / "u.sqlite"), clock)
    led.observe(d, "local", "decode", load(d, "i1", lab_a__=(1, 0, 4, 0, 0, 0)))
    clock.t += 125
    led.observe(d, "local", "decode", load(d, "i1", lab_a__=(3, 0, 12, 0, 0, 0)))
    rep = led.query(since_unix=clock.t - 10, by=["tenant"])
    assert [r.requests for r in rep.rows] == [2]
    assert rep.since_unix == 1_800_000_120.0 and rep.until_unix == clock.t
    assert led.query(by=["tenant"]).rows[0].requests == 3
    assert led.db.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == 2


def test_unknown_group_by_is_refused_by_name():
    with pytest.raises(ValueError, match="'colour'"):
        grouping(["tenant", "colour"])
    assert grouping([]) == ("tenant", "site", "link")
    assert grouping(["worker", "worker", "role"]) == ("worker", "role")


def test_the_database_is_the_router_users_alone(tmp_path):
    path = tmp_path / "new" / "usage.sqlite"
    led = UsageLedger(str(path), Clock())
    led.observe("local/decode/0", "local", "decode", load("local/decode/0", "i1", lab_a__=(1, 0, 1, 0, 0, 0)))
    led.flush()
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    for f in path.parent.iterdir():  # the database and SQLite's -wal and -shm files
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_a_failed_write_keeps_the_rows_for_the_next_one(tmp_path):
    path, d = tmp_path / "u.sqlite", "local/decode/0"
    led = UsageLedger(str(path), Clock())
    led.flush()
    writable = led.db
    led.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
    led.observe(d, "local", "decode", load(d, "i1", lab_a__=(1, 5, 4, 0, 0, 0)))
    assert not led.flush()  # read-only: the write fails
    led.db.close()
    led.db = writable
    assert totals(led, by=["tenant"])[("lab-a", "", "", "", "")][:3] == (1, 5, 4)


# -- kvrelay usage ---------------------------------------------------------------------------------------------
def test_since_takes_durations_and_iso_times():
    now = 1_800_000_000.0
    assert parse_since("-1h", now) == now - 3600 and parse_since("30m", now) == now - 1800
    assert parse_since("2d", now) == now - 2 * 86400 and parse_since("0", now) == 0.0
    assert parse_since("2027-01-15T08:00:00+00:00", now) == 1_800_000_000.0
    with pytest.raises(ValueError, match="yesterday"):
        parse_since("yesterday", now)


def test_counters_naming_a_tenant_or_link_the_config_lacks_are_not_taken(tmp_path, caplog):
    """Issue 56, finding 7: the ledger took any tenant or link string a worker reported, so a
    worker could charge a tenant that does not exist, or bill a link between sites there are not."""
    cfg = parse_config({"sites": [{"name": "montreal"}, {"name": "toronto"}],
                        "tenants": [{"name": "lab-a"}, {"name": "lab-b"}]})
    names = UsageNames.of(cfg, "anonymous")
    assert names.links == {"", "local", "montreal-toronto"}
    led, d = UsageLedger(str(tmp_path / "u.sqlite"), Clock(), names=names), "montreal/decode/0"
    forged = load(d, "i1", lab_a__montreal_toronto=(1, 0, 4, 0, 1000, 0), stranger__=(5, 50, 5, 0, 0, 0),
                  lab_b__montreal_ottawa=(1, 10, 1, 0, 500, 0))
    led.observe(d, "montreal", "decode", forged)
    led.observe(d, "montreal", "decode", forged)  # the same again: counted, logged once
    got = totals(led, by=["tenant", "link"])
    assert got == {("lab-a", "", "montreal-toronto", "", ""): (1, 0, 4, 0, 1000, 0.0, 0.0)}
    assert led.refused == 4
    refusals = [r.getMessage() for r in caplog.records if "not taken" in r.getMessage()]
    assert len(refusals) == 2 and any("tenant 'stranger' is not in the config's tenants" in m for m in refusals)
    assert any("link 'montreal-ottawa' is not between two of the config's sites" in m for m in refusals)
