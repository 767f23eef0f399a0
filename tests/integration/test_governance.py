"""`kvrelay governance` against a running cluster with two tenants: the
statement's answers come from the live config (jurisdictions, a dedicated
pool, retention, link protection, the router's site) and the live workers
(their devices, health and model), and the modes of the router's files from
its disk."""

from __future__ import annotations

import json
import os
import stat

import pytest

from kvrelay.cli.main import main
from kvrelay.router.core.auth import token_sha256
from tests.integration.helpers import running_cluster

pytestmark = pytest.mark.model

CONFIG = {
    "router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0}, "site": "local"},
    "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1},
               "decode": {"replicas": 1, "tenants": ["lab-on"]}},
              {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0}, "decode": {"replicas": 0}}],
    "links": [{"between": ["local", "montreal"], "rtt_ms": 9, "gbps": 10, "protection": "integrity"}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
    "tenants": [{"name": "lab-on", "token_sha256": token_sha256("lab-token"), "jurisdictions": ["CA-ON"],
                 "job_retention_days": 7, "log_prompts": True},
                {"name": "uni-qc", "token_sha256": token_sha256("uni-token"), "jurisdictions": ["CA-QC"]}],
}


@pytest.fixture(scope="module")
def governed_cluster(plumbing_model):
    with running_cluster(CONFIG, plumbing_model) as lc:
        yield lc


def _run(governed_cluster, tmp_path, capsys, *extra: str, token_text: str | None = None) -> tuple[int, str, str]:
    token = tmp_path / "token"
    token.write_text(governed_cluster.operator_token if token_text is None else token_text)
    code = main(["governance", "--router", governed_cluster.router_address, "--ca", str(governed_cluster.ca_file),
                 "--token-file", str(token), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def _answers(doc: dict, tenant: str) -> dict[int, dict]:
    t = next(t for t in doc["tenants"] if t["tenant"] == tenant)
    return {a["question"]: a for a in t["answers"]}


def test_statement_reflects_the_live_config_and_workers(governed_cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVRELAY_OPERATOR_TOKEN", raising=False)
    code, out, err = _run(governed_cluster, tmp_path, capsys, "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert [t["tenant"] for t in doc["tenants"]] == ["lab-on", "uni-qc"]
    lab = _answers(doc, "lab-on")
    pools = {p["pool"]: p for p in lab[2]["facts"]["pools"]}
    assert set(pools) == {"local/prefill", "local/decode"}  # montreal has neither replicas nor workers
    assert pools["local/decode"]["sharing"] == "dedicated" and pools["local/decode"]["dedicated_to"] == ["lab-on"]
    assert pools["local/decode"]["live"]["healthy"] == 1 and pools["local/decode"]["live_devices"] == ["cpu"]
    assert pools["local/prefill"]["sharing"] == "shared" and pools["local/prefill"]["live"]["healthy"] == 1
    assert lab[1]["facts"]["model"]["names"] and "kvrelay-launcher" in lab[1]["facts"]["operator_credentials"]["tokens"]
    assert lab[3]["facts"]["processing_sites"] == [{"site": "local", "jurisdiction": "CA-ON",
                                                    "roles": ["prefill", "decode"]}]
    assert [(lk["link"], lk["protection"], lk["transport"]) for lk in lab[3]["facts"]["kv_links"]] == [
        ("local", "aead", ["tcp"])]
    assert lab[3]["facts"]["stores"]["jobs_db"]["path"] == governed_cluster.cfg.router.records.jobs_db
    assert lab[4]["facts"]["job_retention_days"] == 7 and "carry prompt and output text" in lab[4]["answer"]
    # the router's files as the router read them on disk
    files = lab[5]["facts"]["router_files"]
    for name in ("audit_log", "jobs_db"):
        path = getattr(governed_cluster.cfg.router.records, name)
        assert files[name]["path"] == path and files[name]["state"] == "read"
        assert files[name]["mode"] == f"{stat.S_IMODE(os.stat(path).st_mode):04o}" == "0600"
        assert files[name]["folder_mode"] == f"{stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode):04o}"
    assert f"{governed_cluster.cfg.router.records.audit_log}, mode 0600" in lab[5]["answer"]
    assert "sees its own batch jobs only" in lab[5]["answer"]
    reserve = governed_cluster.cfg.router.admission.interactive_reserve
    assert lab[2]["facts"]["reservations"]["interactive_reserve"] == reserve
    usage = next(e for e in lab[8]["facts"]["exports"] if e["data"] == "usage")
    assert "kvrelay-launcher" in usage["who"] and usage["command"] == "kvrelay usage --tenant lab-on --json"
    assert doc["tenants"][0]["warnings"] == []
    uni = next(t for t in doc["tenants"] if t["tenant"] == "uni-qc")
    assert any("router at local (CA-ON) is outside" in w for w in uni["warnings"])
    assert any("requests are refused" in w for w in uni["warnings"])
    assert [p["pool"] for p in _answers(doc, "uni-qc")[2]["facts"]["pools"]] == []


def test_markdown_for_one_tenant_unknown_tenants_and_a_tenants_own(governed_cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVRELAY_OPERATOR_TOKEN", raising=False)
    code, out, err = _run(governed_cluster, tmp_path, capsys, "--tenant", "lab-on")
    assert code == 0, err
    assert "## Tenant `lab-on`" in out and "uni-qc`" not in out
    assert [n for n in range(1, 9) if f"### {n}. " in out] == list(range(1, 9))
    code, out, err = _run(governed_cluster, tmp_path, capsys, "--tenant", "nobody")
    assert code == 1 and "NOT_FOUND" in err and "'nobody'" in err
    # a tenant's token reads its own statement, never another tenant's, and is no operator's
    code, out, err = _run(governed_cluster, tmp_path, capsys, token_text="lab-token")
    assert code == 0 and "## Tenant `lab-on`" in out and "uni-qc`" not in out, err
    code, out, err = _run(governed_cluster, tmp_path, capsys, "--tenant", "uni-qc", token_text="lab-token")
    assert code == 1 and "PERMISSION_DENIED" in err and out == ""
    assert "reads its own data-handling statement only" in err
    monkeypatch.setenv("KVRELAY_API_KEY", "uni-token")
    code, out, err = _run(governed_cluster, tmp_path, capsys, "--as-tenant", token_text="not-a-token")
    assert code == 0 and "## Tenant `uni-qc`" in out and "lab-on`" not in out, err
    code, out, err = _run(governed_cluster, tmp_path, capsys, token_text="not-a-token")
    assert code == 1 and "UNAUTHENTICATED" in err and out == ""
