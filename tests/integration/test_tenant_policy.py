"""Tenant policy on real processes: two sites on this machine, Montreal
(CA-QC, shared prefill and decode pools) and Toronto (CA-ON, a decode pool
dedicated to lab-on). lab-qc is limited to CA-QC; lab-q has a quota of 6
requests per minute; lab-on's prompts may be logged, nobody else's.
Residency is checked from the workers' own counters, the audit log with
`kvrelay audit verify` and by reading the file."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvrelay.cli.main import main as kvrelay
from kvrelay.router.core.auth import token_sha256
from kvrelay.router.governance.audit_heads import heads_path, load_public_key, read_heads
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import (
    running_cluster,
    tls_context,
    wait_until,
    worker_stats,
    workers,
)

pytestmark = pytest.mark.model

TOKENS = {"lab-qc": "tok-lab-qc", "lab-on": "tok-lab-on", "lab-x": "tok-lab-x", "lab-q": "tok-lab-q"}
SECRET = "the password of the QC lab is PAPAYA-7731"
LOGGED = "a prompt lab-on lets us keep: MANGO-4242"
TORONTO = "toronto/decode/0"


@pytest.fixture(scope="module")
def tenant_cluster(plumbing_model):
    raw = {
        "router": {"port": 0, "http_port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
                   "liveness": {"heartbeat_interval_s": 0.25}, "admission": {"admission_wait_s": 5.0},
                   "records": {"audit_head_interval_s": 0.5}},
        "sites": [{"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                  {"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 0},
                   "decode": {"replicas": 1, "tenants": ["lab-on"]}}],
        "links": [{"between": ["montreal", "toronto"], "rtt_ms": 5, "gbps": 10}],
        "workers": {"threads": 1},
        "cache": {"memory_gib": 0.25},
        "tenants": [{"name": "lab-qc", "token_sha256": token_sha256(TOKENS["lab-qc"]), "jurisdictions": ["CA-QC"]},
                    {"name": "lab-on", "token_sha256": token_sha256(TOKENS["lab-on"]), "log_prompts": True},
                    {"name": "lab-x", "token_sha256": token_sha256(TOKENS["lab-x"])},
                    {"name": "lab-q", "token_sha256": token_sha256(TOKENS["lab-q"]), "requests_per_minute": 6}],
    }
    with running_cluster(raw, plumbing_model, reconcile=False) as lc:
        assert wait_until(lambda: len(workers(lc)) == 3, 60)
        yield lc


def generate(lc, tenant: str, **kw) -> list[ipb.GenerateResponse]:
    kw.setdefault("max_tokens", 2)
    if "prompt" not in kw:
        kw["token_ids"] = ipb.TokenIds(ids=list(range(200, 240)))
    with lc.dialer(TOKENS[tenant]).sync(lc.router_address) as ch:
        return list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(ignore_eos=True, **kw), timeout=120))


def toronto_work(lc) -> tuple[int, int]:
    s = worker_stats(lc, TORONTO)
    return s.prefill_tokens_total, s.decode_tokens_total


def test_lab_qc_is_processed_only_in_montreal(tenant_cluster):
    before = toronto_work(tenant_cluster)
    for kw in ({}, {"allowed_jurisdictions": ["CA-QC"]}, {"allowed_jurisdictions": ["CA-QC", "CA-ON"]}):
        for _ in range(2):
            fin = generate(tenant_cluster, "lab-qc", **kw)[-1].finish
            assert fin.placement.decode_site == fin.placement.prefill_site == "montreal", kw
    assert toronto_work(tenant_cluster) == before  # the Toronto worker's own counters: nothing of lab-qc's ran there


def test_lab_qc_asking_for_ca_on_only_is_refused_naming_both_sets(tenant_cluster):
    with pytest.raises(grpc.RpcError) as err:
        generate(tenant_cluster, "lab-qc", allowed_jurisdictions=["CA-ON"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "{CA-ON}" in err.value.details() and "{CA-QC}" in err.value.details()


def test_a_pool_dedicated_to_lab_on_serves_only_lab_on(tenant_cluster):
    before = toronto_work(tenant_cluster)
    assert {generate(tenant_cluster, "lab-x")[-1].finish.placement.decode_site for _ in range(4)} == {"montreal"}
    assert toronto_work(tenant_cluster) == before
    with pytest.raises(grpc.RpcError) as err:  # the only CA-ON pool is lab-on's: refused at once, not after a wait
        generate(tenant_cluster, "lab-x", allowed_jurisdictions=["CA-ON"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dedicated to other tenants: ['toronto']" in err.value.details()
    fin = generate(tenant_cluster, "lab-on", allowed_jurisdictions=["CA-ON"])[-1].finish
    assert fin.placement.decode_site == "toronto"  # lab-on may use its pool
    assert toronto_work(tenant_cluster) != before


def _http(lc, tenant: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"https://{lc.http_address}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"authorization": f"Bearer {TOKENS[tenant]}",
                                          "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60, context=tls_context(lc)) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def test_the_quota_refuses_the_seventh_request_and_serves_it_after_the_wait(tenant_cluster):
    for _ in range(6):
        generate(tenant_cluster, "lab-q", max_tokens=1)
    with tenant_cluster.dialer(TOKENS["lab-q"]).sync(tenant_cluster.router_address) as ch:
        call = igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(prompt="hi", max_tokens=1), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_minute quota (6)" in err.value.details()
    hint_ms = int(dict(err.value.trailing_metadata())["retry-after-ms"])
    assert 0 < hint_ms <= 10_000
    status, headers, body = _http(tenant_cluster, "lab-q", {"prompt": "hi", "max_tokens": 1})  # the same bucket
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert "requests_per_minute" in body["error"]["message"] and body["error"]["code"] == "resource_exhausted"
    time.sleep(int(headers["retry-after"]) + 0.5)
    status, _, body = _http(tenant_cluster, "lab-q", {"prompt": "hi", "max_tokens": 1})
    assert status == 200 and body["usage"]["completion_tokens"] == 1


def _records(lc) -> list[dict]:
    return [json.loads(line) for line in Path(lc.cfg.router.records.audit_log).read_text().splitlines()]


def test_the_audit_log_verifies_and_keeps_prompts_only_where_allowed(tenant_cluster, capsys):
    generate(tenant_cluster, "lab-qc", prompt=SECRET)
    with pytest.raises(grpc.RpcError):
        generate(tenant_cluster, "lab-qc", prompt=SECRET, allowed_jurisdictions=["CA-ON"])
    generate(tenant_cluster, "lab-on", prompt=LOGGED)
    with tenant_cluster.operator_dialer.sync(tenant_cluster.router_address) as ch:
        agrpc.AdminStub(ch).Scale(apb.ScaleRequest(site="toronto", role="prefill", replicas=0), timeout=30)
    # written by the router's audit thread: wait for both records
    assert wait_until(lambda: any(r.get("prompt") == LOGGED for r in _records(tenant_cluster)) and any(
        r["kind"] == "operator" and r["action"] == "scale" for r in _records(tenant_cluster)), 10)
    text = Path(tenant_cluster.cfg.router.records.audit_log).read_text()
    assert "PAPAYA" not in text  # lab-qc's policy: never
    records = _records(tenant_cluster)
    qc = [r for r in records if r["kind"] == "request" and r.get("tenant") == "lab-qc" and r["outcome"] == "ok"]
    assert qc and all(r["decode_site"] == "montreal" and r["prompt_tokens"] > 0 and r["jurisdictions"] == ["CA-QC"]
                      for r in qc)
    refused = [r for r in records if r.get("tenant") == "lab-qc" and r.get("outcome") == "failed_precondition"]
    assert refused and refused[0]["jurisdictions_requested"] == ["CA-ON"]
    on = next(r for r in records if r.get("prompt") == LOGGED)
    assert on["tenant"] == "lab-on" and on["output"] and on["completion_tokens"] == 2
    assert any(r["kind"] == "operator" and r["action"] == "scale" and r["site"] == "toronto" for r in records)
    capsys.readouterr()
    assert kvrelay(["audit", "verify", tenant_cluster.cfg.router.records.audit_log]) == 0
    assert capsys.readouterr().out.startswith("ok")


def test_a_call_with_a_wrong_token_is_found_by_audit_query_kind_refusal(tenant_cluster, capsys):
    with tenant_cluster.dialer("not-a-token").sync(tenant_cluster.router_address) as ch, \
            pytest.raises(grpc.RpcError) as err:
        list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(prompt="hi", max_tokens=1), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert wait_until(lambda: any(r["kind"] == "refusal" for r in _records(tenant_cluster)), 10)
    capsys.readouterr()
    log = tenant_cluster.cfg.router.records.audit_log
    assert kvrelay(["audit", "query", "--file", log, "--kind", "refusal", "--json"]) == 0
    found = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert found and all(r["kind"] == "refusal" for r in found)
    assert any(r["api"] == "grpc" and r["credential"] == "token" and r["outcome"] == "unauthenticated" for r in found)


def test_the_router_signs_heads_that_find_a_truncated_tail_of_the_real_log(tenant_cluster, tmp_path, capsys):
    rec = tenant_cluster.cfg.router.records
    heads, pub = heads_path(rec.audit_log), rec.audit_signing_key + ".pub"
    for _ in range(3):
        generate(tenant_cluster, "lab-x")

    def covered() -> int:
        signed = read_heads(heads, load_public_key(pub)) if heads.exists() else []
        return max((h.seq for h in signed), default=0)
    assert wait_until(lambda: covered() >= 3, 15), "the router signed no head covering its records"
    copy, heads_copy = tmp_path / "audit.jsonl", tmp_path / "heads.jsonl"
    heads_copy.write_bytes(heads.read_bytes())
    lines = Path(rec.audit_log).read_bytes().splitlines(keepends=True)
    copy.write_bytes(b"".join(lines))
    args = ["audit", "verify", str(copy), "--heads", str(heads_copy), "--key", pub]
    capsys.readouterr()
    assert kvrelay(args) == 0
    assert "signed heads agree" in capsys.readouterr().out
    n = read_heads(heads_copy, load_public_key(pub))[-1].seq
    copy.write_bytes(b"".join(lines[:n - 2]))  # the chain alone still holds: only the heads find it
    assert kvrelay(["audit", "verify", str(copy)]) == 0
    capsys.readouterr()
    assert kvrelay(args) == 1
    said = capsys.readouterr().err
    assert f"the log ends at seq {n - 2}," in said and "were cut from its end" in said, said


def test_verify_names_an_edited_a_deleted_and_an_inserted_record_of_the_real_log(tenant_cluster, tmp_path, capsys):
    for _ in range(4):
        generate(tenant_cluster, "lab-x")
    assert wait_until(lambda: len(_records(tenant_cluster)) >= 6, 10)
    lines = Path(tenant_cluster.cfg.router.records.audit_log).read_bytes().splitlines(keepends=True)
    cases = {"edited": lines[:3] + [lines[3].replace(b'"seq"', b'"seq" ', 1)] + lines[4:],
             "deleted": lines[:3] + lines[4:],
             "inserted": lines[:3] + [lines[2]] + lines[3:]}
    for name, content in cases.items():
        copy = tmp_path / f"{name}.jsonl"
        copy.write_bytes(b"".join(content))
        capsys.readouterr()
        assert kvrelay(["audit", "verify", str(copy)]) == 1, name
        err = capsys.readouterr()
        said = err.out + err.err
        assert "line 4" in said or "seq 4" in said, (name, said)


def test_a_tenant_reads_its_own_usage_and_statement_never_another_tenants(tenant_cluster):
    generate(tenant_cluster, "lab-x")
    generate(tenant_cluster, "lab-qc")

    def usage(token: str | None, tenant: str = "") -> dict[str, int]:
        dial = tenant_cluster.dialer(token) if token else tenant_cluster.operator_dialer
        with dial.sync(tenant_cluster.router_address) as ch:
            rows = agrpc.AdminStub(ch).Usage(apb.UsageRequest(by=["tenant"], tenant=tenant), timeout=10).rows
        return {r.tenant: r.requests for r in rows}
    assert wait_until(lambda: {"lab-x", "lab-qc"} <= usage(None).keys(), 15), usage(None)
    assert set(usage(TOKENS["lab-x"])) == {"lab-x"} and usage(TOKENS["lab-x"])["lab-x"] >= 1
    with pytest.raises(grpc.RpcError) as err:
        usage(TOKENS["lab-x"], tenant="lab-qc")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant 'lab-x' reads its own usage only, not tenant 'lab-qc'" in err.value.details()
    with tenant_cluster.dialer(TOKENS["lab-x"]).sync(tenant_cluster.router_address) as ch:
        doc = json.loads(agrpc.AdminStub(ch).Governance(apb.GovernanceRequest(), timeout=10).statement_json)
        with pytest.raises(grpc.RpcError) as err:
            agrpc.AdminStub(ch).Governance(apb.GovernanceRequest(tenant="lab-on"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:  # a tenant is no operator
            agrpc.AdminStub(ch).Scale(apb.ScaleRequest(site="toronto", role="decode", replicas=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [t["tenant"] for t in doc["tenants"]] == ["lab-x"] and "workers" not in doc["deployment"]
    with tenant_cluster.dialer("not-a-token").sync(tenant_cluster.router_address) as ch, \
            pytest.raises(grpc.RpcError) as err:
        agrpc.AdminStub(ch).Usage(apb.UsageRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert wait_until(lambda: any(r["kind"] == "read" and r["tenant"] == "lab-x" and r["action"] == "usage"
                                  for r in _records(tenant_cluster)), 10)
