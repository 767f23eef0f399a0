"""Usage accounting on real processes: two tenants and two sites on this
machine (Toronto: a prefill and a decode worker; Montreal: a decode worker;
a link between them), a mixed workload (long prompts disaggregated over the
local link or the Toronto-Montreal one, short ones colocated, repeated ones
hitting the prefix cache, both tenants in the same engine steps). `kvrelay
usage` must equal the sums of the counters each worker reports itself
(its Stats), match per tenant what the clients received, and stay exact
across a router restart (SIGKILL)."""

from __future__ import annotations

import json
import random
import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvrelay.cli.main import main
from kvrelay.router.core.auth import token_sha256
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import (
    running_cluster,
    wait_until,
    worker_stats,
    workers,
)

pytestmark = pytest.mark.model

TOKENS = {"lab-a": secrets.token_urlsafe(24), "lab-b": secrets.token_urlsafe(24)}
WORKERS = ["toronto/prefill/0", "toronto/decode/0", "montreal/decode/0"]
ALL = "tenant,site,link,role,worker"
LONG, SHORT = 200, 20
"""Prompt lengths: at least router.placement.colocate_below_tokens goes to the prefill worker."""
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "kv_bytes")


def config(usage_db) -> dict:
    return {
        # round_robin: decode workers in turn, so long prompts cross both links; short ones colocated
        "router": {"port": 0, "placement": {"policy": "round_robin", "colocate_below_tokens": 64},
                   "liveness": {"heartbeat_interval_s": 0.25}, "records": {"usage_db": str(usage_db)}},
        "sites": [{"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                  {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0},
                   "decode": {"replicas": 1}}],
        "links": [{"between": ["toronto", "montreal"], "rtt_ms": 5, "gbps": 10}],
        "tenants": [{"name": t, "token_sha256": token_sha256(tok)} for t, tok in TOKENS.items()],
        "workers": {"threads": 1},
        "cache": {"memory_gib": 0.25},
    }


@pytest.fixture(scope="module")
def usage_cluster(plumbing_model, tmp_path_factory):
    db = tmp_path_factory.mktemp("usage") / "usage.sqlite"
    with running_cluster(config(db), plumbing_model) as lc:
        assert wait_until(lambda: sum(w.healthy for w in workers(lc).values()) == 3, 60)
        yield lc


class Sent:
    """What the clients sent and received, per tenant."""

    def __init__(self) -> None:
        self.by_tenant = {t: dict(requests=0, prompt=0, completion=0, cached=0, kv_bytes=0) for t in TOKENS}
        self.links: set[str] = set()

    def generate(self, lc, tenant: str, ids: list[int]) -> None:
        req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=3, ignore_eos=True)
        with lc.dialer(TOKENS[tenant]).sync(lc.router_address) as ch:
            msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=120))
        fin = msgs[-1].finish
        s = self.by_tenant[tenant]
        s["requests"] += 1
        s["prompt"] += fin.usage.prompt_tokens
        s["completion"] += sum(len(m.token_ids) for m in msgs)
        s["cached"] += fin.usage.cached_prompt_tokens
        s["kv_bytes"] += fin.placement.kv_bytes
        self.links.add(fin.placement.link)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def workload(lc, sent: Sent, seed: int) -> None:
    """Both tenants at once (shared engine steps), then repeats one by one
    (prefix-cache hits; consecutive turns put long prompts on both decode workers)."""
    rng = random.Random(seed)
    long_a, long_b = prompt(rng, LONG), prompt(rng, LONG)
    wave = [("lab-a", long_a), ("lab-a", prompt(rng, SHORT)), ("lab-a", prompt(rng, LONG + 37)),
            ("lab-b", long_b), ("lab-b", prompt(rng, SHORT)), ("lab-b", prompt(rng, SHORT + 5))]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda tp: sent.generate(lc, *tp), wave))
    for tenant, ids in [("lab-a", long_a), ("lab-b", long_b), ("lab-a", long_a), ("lab-b", prompt(rng, SHORT))]:
        sent.generate(lc, tenant, ids)


def worker_rows(lc) -> dict[tuple, dict]:
    """Every worker's own counters, read from the worker (Stats), as usage rows."""
    rows = {}
    for wid in WORKERS:
        load = worker_stats(lc, wid)
        site, role, _ = wid.split("/")
        for u in load.usage:
            if not any(getattr(u, f) for f in (*COUNTS, "engine_ns")):
                continue  # nothing for the ledger to record
            row = {f: getattr(u, f) for f in COUNTS}
            row["prefill_worker_s"] = u.engine_ns / 1e9 if role == "prefill" else 0.0
            row["decode_worker_s"] = u.engine_ns / 1e9 if role == "decode" else 0.0
            rows[(u.tenant, site, u.link, role, wid)] = row
    return rows


def kvrelay_usage(lc, capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.setenv("KVRELAY_OPERATOR_TOKEN", lc.operator_token)
    capsys.readouterr()
    rc = main(["usage", *args, "--router", lc.router_address, "--ca", str(lc.ca_file)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def ledger_rows(lc, capsys, monkeypatch) -> dict[tuple, dict]:
    rc, out, err = kvrelay_usage(lc, capsys, monkeypatch, "--json", "--by", ALL)
    assert rc == 0, err
    rows = json.loads(out)["rows"]
    return {(r["tenant"], r["site"], r["link"], r["role"], r["worker"]): {k: r[k] for k in (*COUNTS,
            "prefill_worker_s", "decode_worker_s")} for r in rows}


def assert_ledger_equals_workers(lc, capsys, monkeypatch, timeout_s: float = 20.0) -> dict[tuple, dict]:
    """Polls (heartbeats every 0.25 s) until `kvrelay usage` equals the workers' own counters."""
    seen = {}

    def equal() -> bool:
        seen["workers"], seen["ledger"] = worker_rows(lc), ledger_rows(lc, capsys, monkeypatch)
        return seen["workers"] == seen["ledger"]
    assert wait_until(equal, timeout_s, 0.5), f"ledger {seen['ledger']}\n!= workers {seen['workers']}"
    return seen["ledger"]


def test_usage_totals_are_the_sums_of_the_workers_own_counters(usage_cluster, capsys, monkeypatch):
    sent = Sent()
    workload(usage_cluster, sent, seed=3)
    rows = assert_ledger_equals_workers(usage_cluster, capsys, monkeypatch)
    assert {"", "local", "montreal-toronto"} <= sent.links
    assert {k[2] for k in rows} == {"", "local", "montreal-toronto"}
    for tenant, s in sent.by_tenant.items():
        mine = [r for k, r in rows.items() if k[0] == tenant]
        total = {f: sum(r[f] for r in mine) for f in (*COUNTS, "prefill_worker_s", "decode_worker_s")}
        assert total["requests"] == s["requests"]
        assert total["completion_tokens"] == s["completion"]
        assert total["prompt_tokens"] + total["cached_tokens"] == s["prompt"]
        assert 0 < total["cached_tokens"] <= s["cached"]
        assert total["kv_bytes"] == s["kv_bytes"] > 0
        assert total["prefill_worker_s"] > 0 and total["decode_worker_s"] > 0
    # the ledger groups as asked: per tenant (the default adds site and link), one tenant only
    rc, out, _ = kvrelay_usage(usage_cluster, capsys, monkeypatch, "--json", "--by", "tenant")
    by_tenant = {r["tenant"]: r for r in json.loads(out)["rows"]}
    assert rc == 0 and sorted(by_tenant) == ["lab-a", "lab-b"]
    assert by_tenant["lab-b"]["completion_tokens"] == sent.by_tenant["lab-b"]["completion"]
    rc, out, _ = kvrelay_usage(usage_cluster, capsys, monkeypatch, "--json", "--tenant", "lab-a")
    assert rc == 0 and {r["tenant"] for r in json.loads(out)["rows"]} == {"lab-a"}
    rc, out, _ = kvrelay_usage(usage_cluster, capsys, monkeypatch, "--since", "1h", "--by", "tenant,site,link,role")
    assert rc == 0 and "TOTAL" in out and "montreal-toronto" in out
    with capsys.disabled():
        print(f"\nkvrelay usage --by tenant,site,link,role:\n{out}")


def test_usage_refuses_an_unknown_grouping_by_name(usage_cluster, capsys, monkeypatch):
    rc, _, err = kvrelay_usage(usage_cluster, capsys, monkeypatch, "--by", "tenant,colour")
    assert rc == 1 and "INVALID_ARGUMENT" in err and "'colour'" in err


def test_a_router_restart_neither_loses_nor_double_counts(usage_cluster, capsys, monkeypatch):
    before = assert_ledger_equals_workers(usage_cluster, capsys, monkeypatch)
    usage_cluster.restart_router(kill=True)
    assert wait_until(lambda: sum(w.healthy for w in workers(usage_cluster).values()) == 3, 30)
    sent = Sent()
    for tenant in TOKENS:
        sent.generate(usage_cluster, tenant, prompt(random.Random(tenant), LONG))
    after = assert_ledger_equals_workers(usage_cluster, capsys, monkeypatch)
    for tenant in TOKENS:
        grew = sum(r["requests"] for k, r in after.items() if k[0] == tenant) - \
            sum(r["requests"] for k, r in before.items() if k[0] == tenant)
        assert grew == 1
