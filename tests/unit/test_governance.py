"""The data-handling statement (router/governance/statement.py) is derived from the
config and the live state: changing a jurisdiction, a dedicated pool, a
retention period, a link's protection, the router's site, the operators,
the interactive reserve or the router's files on disk changes the answer
that depends on it, and the Markdown rendering has every question."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os

import pytest

from kvrelay.cli.governance import render_markdown
from kvrelay.router.cluster.registry import WorkerRegistry
from kvrelay.router.cluster.usage import UsageLedger
from kvrelay.router.governance.deployment import LinkState, LiveWorker, file_states
from kvrelay.router.governance.statement import (
    NOT_RECORDED,
    DeploymentState,
    Question,
    UnknownTenant,
    deployment_state,
    statement,
)
from kvrelay.runtime.config import ClusterConfig, parse_config
from kvrelay.runtime.roles import Role
from kvrelay.v1 import worker_pb2 as wpb

BASE = {
    "router": {"site": "toronto", "records": {"audit_log": "/srv/kvrelay/audit.jsonl",
                                              "jobs_db": "/srv/kvrelay/jobs.sqlite",
                                              "usage_db": "/srv/kvrelay/usage.sqlite"}},
    "sites": [{"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
              {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
              {"name": "vancouver", "jurisdiction": "CA-BC", "prefill": {"replicas": 0}, "decode": {"replicas": 0}}],
    "links": [{"between": ["toronto", "montreal"], "rtt_ms": 9, "gbps": 10, "transport": "tcp"}],
    "auth": {"operators": [{"name": "noc", "token_sha256": "c" * 64}]},
    "tenants": [{"name": "lab-qc", "token_sha256": "a" * 64, "jurisdictions": ["CA-QC"]},
                {"name": "uni-on", "token_sha256": "b" * 64, "requests_per_minute": 60}],
}
STATE = DeploymentState(
    workers=[LiveWorker("toronto/prefill/0", "toronto", Role.PREFILL, "cuda:0", True, False, "tcp", "SmolLM2"),
             LiveWorker("toronto/decode/0", "toronto", Role.DECODE, "cuda:1", True, False, "tcp", "SmolLM2"),
             LiveWorker("montreal/prefill/0", "montreal", Role.PREFILL, "cpu", True, False, "tcp", "SmolLM2"),
             LiveWorker("montreal/decode/0", "montreal", Role.DECODE, "cpu", False, False, "tcp", "SmolLM2")],
    links={"montreal-toronto": LinkState(True)}, version="9.9.9", generated_at=1_700_000_000.0)


def _raw(edit=None) -> dict:
    """BASE after ``edit(raw)``."""
    raw = copy.deepcopy(BASE)
    if edit is not None:
        edit(raw)
    return raw


def _doc(edit=None, state: DeploymentState = STATE, tenant: str | None = None) -> dict:
    """The statement of BASE after ``edit(raw)``; always plain JSON data."""
    doc = statement(parse_config(_raw(edit)), state, tenant)
    assert json.loads(json.dumps(doc)) == doc
    return doc


def _answer(doc: dict, tenant: str, q: Question) -> dict:
    t = next(t for t in doc["tenants"] if t["tenant"] == tenant)
    a = t["answers"][q - 1]
    assert a["question"] == q and a["title"] == q.title
    return a


def _tenant(raw: dict, name: str) -> dict:
    return next(t for t in raw["tenants"] if t["name"] == name)


def test_shape_and_every_tenant_answers_eight_questions():
    doc = _doc()
    assert set(doc) == {"generated_at", "deployment", "tenants"} and doc["generated_at"] == "2023-11-14T22:13:20Z"
    assert [t["tenant"] for t in doc["tenants"]] == ["lab-qc", "uni-on"]
    for t in doc["tenants"]:
        assert [a["question"] for a in t["answers"]] == list(range(1, 9))
        assert all(a["answer"] and isinstance(a["facts"], dict) for a in t["answers"])
    assert doc["deployment"]["kvrelay_version"] == "9.9.9"
    assert [t["tenant"] for t in _doc(tenant="uni-on")["tenants"]] == ["uni-on"]
    with pytest.raises(UnknownTenant, match=r"'nobody'.*lab-qc, uni-on"):
        _doc(tenant="nobody")


def test_jurisdiction_changes_the_sites_answer():
    before = _answer(_doc(), "lab-qc", Question.JURISDICTIONS)
    assert [s["site"] for s in before["facts"]["processing_sites"]] == ["montreal"]
    assert "montreal (CA-QC)" in before["answer"] and "toronto (CA-ON); KV" not in before["answer"]

    def to_ontario(raw):
        _tenant(raw, "lab-qc")["jurisdictions"] = ["CA-ON"]
    after = _answer(_doc(to_ontario), "lab-qc", Question.JURISDICTIONS)
    assert [s["site"] for s in after["facts"]["processing_sites"]] == ["toronto"]
    assert after["facts"]["jurisdictions_reached"] == ["CA-ON"] and after["answer"] != before["answer"]
    # no jurisdictions: anywhere live; the site without replicas or workers is not reached
    anywhere = _answer(_doc(), "uni-on", Question.JURISDICTIONS)
    assert [s["site"] for s in anywhere["facts"]["processing_sites"]] == ["toronto", "montreal"]
    assert [lk["link"] for lk in anywhere["facts"]["kv_links"]] == ["local", "montreal-toronto"]
    scaled = dataclasses.replace(STATE, desired={("vancouver", Role.DECODE): 1})
    assert "vancouver" in [s["site"] for s in _answer(_doc(state=scaled), "uni-on", Question.JURISDICTIONS)
                           ["facts"]["processing_sites"]]


def test_dedicated_pool_changes_both_tenants_accelerator_answers():
    shared = _doc()
    pools = {p["pool"]: p for p in _answer(shared, "uni-on", Question.ACCELERATORS)["facts"]["pools"]}
    assert pools["montreal/decode"]["sharing"] == "shared" and pools["montreal/decode"]["other_tenants"] == ["lab-qc"]

    def dedicate(raw):
        raw["sites"][1]["decode"]["tenants"] = ["lab-qc"]
    doc = _doc(dedicate)
    lab = _answer(doc, "lab-qc", Question.ACCELERATORS)
    mine = {p["pool"]: p for p in lab["facts"]["pools"]}["montreal/decode"]
    assert mine["sharing"] == "dedicated" and mine["dedicated_to"] == ["lab-qc"] and mine["other_tenants"] == []
    assert "dedicated to this tenant only: montreal/decode" in lab["answer"]
    uni = _answer(doc, "uni-on", Question.ACCELERATORS)
    assert "montreal/decode" not in {p["pool"] for p in uni["facts"]["pools"]}
    assert [p["pool"] for p in uni["facts"]["closed_to_it"]] == ["montreal/decode"]
    assert "dedicated to other tenants, never used for it: montreal/decode" in uni["answer"]
    assert uni["answer"] != _answer(shared, "uni-on", Question.ACCELERATORS)["answer"]
    # live devices and health come from the workers
    assert {p["pool"]: p for p in uni["facts"]["pools"]}["toronto/decode"]["live_devices"] == ["cuda:1"]


def test_retention_changes_the_retention_answer():
    before = _answer(_doc(), "uni-on", Question.RETENTION)
    assert before["facts"]["job_retention_days"] == 30 and "deleted 30 days after" in before["answer"]

    def shorter(raw):
        _tenant(raw, "uni-on").update(job_retention_days=7, audit_retention_days=90, log_prompts=True)
    after = _answer(_doc(shorter), "uni-on", Question.RETENTION)
    assert after["facts"]["job_retention_days"] == 7 and after["facts"]["audit_retention_days"] == 90
    assert "deleted 7 days after" in after["answer"] and "90 days after their time" in after["answer"]
    assert "never carry prompt" in before["answer"] and "carry prompt and output text" in after["answer"]
    assert after["facts"]["other_uses"] == NOT_RECORDED


def test_link_protection_changes_the_encryption_answers():
    def links(doc, q):
        return {lk["link"]: lk for lk in _answer(doc, "uni-on", q)["facts"]["kv_links"]}
    before = _doc()
    assert links(before, Question.JURISDICTIONS)["montreal-toronto"]["protection"] == "aead"

    def integrity(raw):
        raw["links"][0]["protection"] = "integrity"
    after = _doc(integrity)
    link = links(after, Question.JURISDICTIONS)["montreal-toronto"]
    assert link["protection"] == "integrity" and not link["encrypted"]
    assert links(after, Question.IDENTITY)["montreal-toronto"]["encrypted"] is False
    assert "montreal-toronto (tcp, integrity)" in _answer(after, "uni-on", Question.IDENTITY)["answer"]
    access = _answer(after, "uni-on", Question.ACCESS)
    assert access["facts"]["links_readable_on_the_wire"] == ["montreal-toronto"]
    assert "readable on the wire of montreal-toronto" in access["answer"]
    assert "readable on the wire" not in _answer(before, "uni-on", Question.ACCESS)["answer"]


def test_a_link_codec_is_stated_per_tenant_and_kv_lossy_false_is_never_coded():
    def coded(raw):
        raw["links"][0]["kv_codec"] = "int4"
        _tenant(raw, "lab-qc")["kv_lossy"] = False
        _tenant(raw, "lab-qc")["jurisdictions"] = []  # so that its KV may cross the link
    doc = _doc(coded)
    for tenant, codec in (("uni-on", "int4"), ("lab-qc", "none")):
        for q in (Question.JURISDICTIONS, Question.IDENTITY):
            link = next(lk for lk in _answer(doc, tenant, q)["facts"]["kv_links"] if lk["link"] == "montreal-toronto")
            assert link["kv_codec"] == codec, (tenant, q)
    assert "montreal-toronto (tcp, aead, KV coded int4: fewer bytes, answers may differ" in \
        _answer(doc, "uni-on", Question.JURISDICTIONS)["answer"]
    assert "KV coded" not in _answer(doc, "lab-qc", Question.JURISDICTIONS)["answer"]
    assert "KV coded" not in _answer(_doc(), "uni-on", Question.JURISDICTIONS)["answer"]


def test_router_outside_the_tenants_jurisdictions_is_a_warning():
    doc = _doc()
    lab = next(t for t in doc["tenants"] if t["tenant"] == "lab-qc")
    assert any("router at toronto (CA-ON) is outside" in w for w in lab["warnings"])
    assert "WARNING: the router at toronto (CA-ON)" in _answer(doc, "lab-qc", Question.JURISDICTIONS)["answer"]
    assert next(t for t in doc["tenants"] if t["tenant"] == "uni-on")["warnings"] == []

    def in_quebec(raw):
        raw["router"]["site"] = "montreal"
    assert all(not t["warnings"] for t in _doc(in_quebec)["tenants"])

    def undeclared(raw):
        del raw["router"]["site"]
    assert all(any("not declared (router.site)" in w for w in t["warnings"]) for t in _doc(undeclared)["tenants"])


def test_no_open_decode_pool_is_a_warning():
    def dedicate_both(raw):
        raw["sites"][0]["decode"]["tenants"] = ["uni-on"]
        raw["sites"][1]["decode"]["tenants"] = ["uni-on"]
    lab = next(t for t in _doc(dedicate_both)["tenants"] if t["tenant"] == "lab-qc")
    assert any("requests are refused" in w for w in lab["warnings"])


def test_the_identity_answer_names_the_openid_providers_and_which_claims_map_to_whom():
    def federate(raw):
        raw["identity"] = {"oidc": [{"name": "eduid", "issuer": "https://login.example.ca", "audience": "urn:kvrelay",
                                     "rules": [{"claim": "groups", "value": "uni-on-members", "tenant": "uni-on"},
                                               {"claim": "groups", "value": "lab-qc", "tenant": "lab-qc"},
                                               {"claim": "groups", "value": "noc", "operator": "noc"}]}]}
    a = _answer(_doc(federate), "uni-on", Question.IDENTITY)
    assert a["facts"]["sign_in"]["openid_token"] is True
    [p] = a["facts"]["federated_identity"]
    assert p["issuer"] == "https://login.example.ca" and p["as_this_tenant"] == ["groups=uni-on-members"]
    assert p["as_operators"] == ["groups=noc (operator noc)"] and p["as_other_tenants"] == 1
    assert ("OpenID Connect provider eduid (issuer https://login.example.ca, audience urn:kvrelay, RS256/ES256 "
            "signatures checked against its published keys): tokens whose groups=uni-on-members act as this tenant, "
            "groups=noc (operator noc) as operators") in a["answer"]


def test_operators_identity_and_what_is_not_recorded():
    doc = _doc()
    ops = _answer(doc, "uni-on", Question.OPERATORS)
    assert ops["facts"]["operator_credentials"]["tokens"] == ["noc"] and "SmolLM2" in ops["answer"]
    assert ops["facts"]["site_and_hardware_operator"] == NOT_RECORDED
    ident = _answer(doc, "uni-on", Question.IDENTITY)["facts"]
    assert ident["sign_in"] == {"token": True, "client_certificate": True, "openid_token": False, "anonymous": False}
    assert ident["policy"]["requests_per_minute"] == 60 and ident["federated_identity"] == "not configured"
    resp = _answer(doc, "uni-on", Question.RESPONSIBILITY)
    assert resp["facts"]["telemetry"]["traces"] == "none" and resp["facts"]["incident_response"] == NOT_RECORDED
    assert "not traced" in resp["answer"]

    def anonymous(raw):
        raw["auth"]["allow_anonymous"] = True
        raw["tls"] = {"enabled": False}
    doc = _doc(anonymous)
    assert [t["tenant"] for t in doc["tenants"]][-1] == "anonymous"
    assert _answer(doc, "anonymous", Question.IDENTITY)["facts"]["sign_in"] == {
        "token": False, "client_certificate": False, "openid_token": False, "anonymous": True}
    assert "TLS is off" in _answer(doc, "anonymous", Question.IDENTITY)["answer"]


def test_the_telemetry_section_is_reported():
    raw = copy.deepcopy(BASE)
    raw["telemetry"] = {"traces": "otlp", "endpoint": "https://collector.example:4317", "sample_ratio": 0.25}
    resp = _answer(statement(parse_config(raw), STATE), "uni-on", Question.RESPONSIBILITY)
    facts = resp["facts"]["telemetry"]
    assert facts["traces"] == "otlp" and facts["trace_destination"] == "https://collector.example:4317"
    assert "collector.example" in resp["answer"] and "never prompt or output text" in resp["answer"]


def test_markdown_has_all_eight_questions_per_tenant():
    doc = _doc()
    md = render_markdown(doc)
    for t in doc["tenants"]:
        section = md.split(f"## Tenant `{t['tenant']}`")[1].split("## Tenant")[0]
        for q in Question:
            assert f"### {int(q)}. {q.title}" in section
        assert section.count("Facts:") == 8
    assert "> **WARNING:** the router at toronto" in md


def test_deployment_state_from_a_registry(tmp_path):
    raw = copy.deepcopy(BASE)
    raw["router"]["records"] |= {"audit_log": str(tmp_path / "audit.jsonl"),
                                 "jobs_db": str(tmp_path / "jobs.sqlite"),
                                 "usage_db": str(tmp_path / "usage.sqlite")}  # the router's ledger makes the usage file

    async def run() -> DeploymentState:
        cfg = parse_config(raw)
        ledger = UsageLedger(cfg.router.records.usage_db)
        reg = WorkerRegistry(cfg, on_load=ledger.observe)
        try:
            await reg.register(wpb.WorkerInfo(worker_id="montreal/decode/0", role=Role.DECODE.proto, site="montreal",
                                              address="127.0.0.1:1", device="cuda:0", transport="tcp", model="m"))
            return deployment_state(reg, {("montreal", Role.DECODE): 2}, now=5.0)
        finally:
            await reg.close()
            await ledger.close()
    state = asyncio.run(run())
    assert state.workers == [
        LiveWorker("montreal/decode/0", "montreal", Role.DECODE, "cuda:0", True, False, "tcp", "m")]
    assert state.desired == {("montreal", "decode"): 2} and state.links == {"montreal-toronto": LinkState(True, "")}
    assert state.generated_at == 5.0 and state.version != ""
    # the router's files as read on disk: the ledger's is 0600, the others not written yet
    assert state.files["usage_db"].mode == 0o600 and state.files["usage_db"].folder == str(tmp_path)
    assert state.files["audit_log"].mode is None and state.files["audit_log"].error == "missing"


def test_tenants_see_their_own_jobs_usage_and_statement():
    doc = _doc()
    a = _answer(doc, "uni-on", Question.ACCESS)
    assert "sees its own batch jobs only" in a["answer"] and "jobs and usage" not in a["answer"]
    assert "it reads its own usage and this statement, never another tenant's" in a["answer"]
    assert a["facts"]["tenant_sees"]["jobs"] == "its own only"
    assert a["facts"]["tenant_sees"]["usage"].startswith("its own only")
    assert "holders of operator tokens (noc) and of any operator certificate" in a["answer"]

    def more_operators_no_tls(raw):
        raw["auth"]["operators"].append({"name": "sre", "token_sha256": "d" * 64})
        raw["tls"] = {"enabled": False}
    after = _answer(_doc(more_operators_no_tls), "uni-on", Question.ACCESS)
    assert "holders of operator tokens (noc and sre) scale and drain" in after["answer"]
    assert "certificate from the cluster CA" not in after["answer"]


def test_portability_says_who_can_take_each_out():
    doc = _doc()
    exports = {e["data"]: e for e in _answer(doc, "lab-qc", Question.PORTABILITY)["facts"]["exports"]}
    text = _answer(doc, "lab-qc", Question.PORTABILITY)["answer"]
    assert exports["batch jobs and results"]["who"] == "the tenant itself (its own credential)"
    assert "kvrelay job results <job-id>" in exports["batch jobs and results"]["command"]
    assert exports["audit records"]["who"] == ("through the operators: whoever can read /srv/kvrelay/audit.jsonl on "
                                               "the router's host")
    assert exports["audit records"]["command"] == ("kvrelay audit query --file /srv/kvrelay/audit.jsonl "
                                                   "--tenant lab-qc --json")
    assert exports["usage"]["who"].startswith("through the operators: the holders of operator tokens (noc)")
    assert exports["usage"]["command"] == "kvrelay usage --tenant lab-qc --json"
    assert "It takes out its own batch jobs itself" in text and "Through the operators: its audit records" in text
    assert "needs operator credentials (the holders of operator tokens (noc)" in text

    def other_operators_no_audit(raw):
        raw["auth"]["operators"] = [{"name": "ops-team", "token_sha256": "e" * 64}]
        del raw["router"]["records"]["audit_log"]
    after = _answer(_doc(other_operators_no_audit), "lab-qc", Question.PORTABILITY)
    exports = {e["data"]: e for e in after["facts"]["exports"]}
    assert exports["audit records"]["command"] is None and exports["audit records"]["who"].startswith("nobody")
    assert "(ops-team)" in exports["usage"]["who"] and "noc" not in after["answer"]
    assert "no audit records (router.records.audit_log is not set)" in after["answer"]


def test_backups_are_not_recorded_unless_a_section_says():
    a = _answer(_doc(), "uni-on", Question.JURISDICTIONS)
    assert a["facts"]["backups"] == NOT_RECORDED and "none configured" not in a["answer"]
    assert f"host backups are outside kvrelay's configuration, so whether and where these files are backed up is " \
           f"{NOT_RECORDED}" in a["answer"]

    @dataclasses.dataclass(slots=True)
    class Backups:
        target: str = "s3://backups.example/kvrelay"

    @dataclasses.dataclass(slots=True)
    class WithBackups(ClusterConfig):
        backups: Backups = dataclasses.field(default_factory=Backups)

    base = parse_config(copy.deepcopy(BASE))
    cfg = WithBackups(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ClusterConfig)})
    after = _answer(statement(cfg, STATE), "uni-on", Question.JURISDICTIONS)
    assert after["facts"]["backups"] == {"target": "s3://backups.example/kvrelay"}
    assert "Backups: target s3://backups.example/kvrelay." in after["answer"]


def test_interactive_reserve_is_reported_as_reserved_capacity():
    a = _answer(_doc(), "uni-on", Question.ACCELERATORS)
    assert a["facts"]["reservations"]["interactive_reserve"] == 1
    assert a["facts"]["reservations"]["max_inflight_per_worker"] == 64
    assert "batch (job) requests leave 1 of its 64 slots free" in a["answer"]
    assert "engines admit waiting interactive prompts before batch ones" in a["answer"]
    assert "No capacity is reserved otherwise" not in a["answer"]

    def bigger(raw):
        raw["router"]["admission"] = {"interactive_reserve": 3, "max_inflight_per_worker": 8, "job_concurrency": 2}
    after = _answer(_doc(bigger), "uni-on", Question.ACCELERATORS)
    assert after["facts"]["reservations"]["interactive_reserve"] == 3
    assert "leave 3 of its 8 slots free" in after["answer"] and "at most 2 at once" in after["answer"]

    def none(raw):
        raw["router"]["admission"] = {"interactive_reserve": 0}
    assert "no slot (router.admission.interactive_reserve is 0): batch (job) requests may take all 64 slots" in _answer(
        _doc(none), "uni-on", Question.ACCELERATORS)["answer"]


def test_file_modes_are_read_from_disk(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    os.chmod(folder, 0o755)  # kvrelay serve's cache folder keeps the mode it already had
    audit = folder / "audit.jsonl"
    audit.touch()
    os.chmod(audit, 0o600)

    def at(raw):
        raw["router"]["records"] |= {"audit_log": str(audit), "jobs_db": str(folder / "jobs.sqlite")}
        del raw["router"]["records"]["usage_db"]
    cfg = parse_config(_raw(at))

    def access(state):
        return _answer(statement(cfg, state), "uni-on", Question.ACCESS)
    a = access(dataclasses.replace(STATE, files=file_states(cfg)))
    files = a["facts"]["router_files"]
    assert files["audit_log"] | {"owner_uid": None} == {
        "path": str(audit), "state": "read", "mode": "0600", "readable_by": "its owner only", "owner_uid": None,
        "folder": str(folder), "folder_mode": "0755", "folder_state": "read"}
    assert f"the audit log {audit}, mode 0600 (readable by its owner only), in {folder}, mode 0755" in a["answer"]
    assert files["jobs_db"]["state"] == "missing"
    assert f"the jobs database {folder / 'jobs.sqlite'}: missing on disk" in a["answer"]
    assert files["usage_db"]["state"] == "not set"
    assert ("the usage database: not set (router.records.usage_db; usage is kept in the router's memory only)"
            in a["answer"])
    assert "0700" not in a["answer"]
    # the modes change on disk: so does the answer
    os.chmod(audit, 0o644)
    os.chmod(folder, 0o700)
    after = access(dataclasses.replace(STATE, files=file_states(cfg)))
    assert f"the audit log {audit}, mode 0644 (readable by any user), in {folder}, mode 0700" in after["answer"]
    # a snapshot that read nothing says so, and claims no mode
    unread = access(STATE)
    assert unread["facts"]["router_files"]["audit_log"] == {"path": str(audit), "state": "not read"}
    assert f"the audit log {audit} (its mode was not read)" in unread["answer"]
    assert _doc()["deployment"]["files"]["audit_log"]["state"] == "not read"


def test_retention_follows_the_stores_and_the_cache():
    before = _answer(_doc(), "uni-on", Question.RETENTION)
    assert "kept in the jobs database" in before["answer"] and "never deleted by kvrelay" in before["answer"]
    assert "1 GiB per worker" in before["answer"] and "reused only for its own requests" in before["answer"]
    assert "runs when it starts and every 3600 s" in before["answer"]

    def changed(raw):
        for name in ("audit_log", "jobs_db", "usage_db"):
            del raw["router"]["records"][name]
        raw["router"]["records"]["retention_sweep_s"] = 600
        raw["cache"] = {"num_blocks": 512, "enable_prefix_caching": False}
    after = _answer(_doc(changed), "uni-on", Question.RETENTION)
    assert "kept in the router's memory only (router.records.jobs_db is not set)" in after["answer"]
    assert "Nothing is audited (router.records.audit_log is not set)" in after["answer"]
    assert "carry prompt" not in after["answer"] and "every 600 s" in after["answer"]
    assert "Usage records are kept in the router's memory only" in after["answer"]
    assert "512 blocks of 16 tokens per worker" in after["answer"]
    assert "never reused for another prompt (cache.enable_prefix_caching is false)" in after["answer"]
    assert after["facts"]["kv_cache"]["prefix_caching"] is False
    access = _answer(_doc(changed), "uni-on", Question.ACCESS)["answer"]
    assert "no prefix cache: cache.enable_prefix_caching is false" in access
    assert "the jobs database holds" not in access


def test_responsibility_names_what_is_audited_and_that_plans_are_advice():
    a = _answer(_doc(), "uni-on", Question.RESPONSIBILITY)
    assert ("scale, drain, plan apply, usage and governance calls, and calls refused for their credentials, are "
            "written to the audit log (/srv/kvrelay/audit.jsonl)") in a["answer"]
    assert "applied only when an operator runs it with --apply" in a["answer"]

    def unaudited(raw):
        del raw["router"]["records"]["audit_log"]
    assert "are not audited (router.records.audit_log is not set)" in _answer(
        _doc(unaudited), "uni-on", Question.RESPONSIBILITY)["answer"]


def test_the_statement_lists_exactly_the_admin_calls_that_are_audited():
    import re
    from pathlib import Path

    from kvrelay.router.governance.statement import AUDITED_ACTIONS
    source = (Path(__file__).parents[2] / "router" / "frontends" / "admin.py").read_text()
    assert set(re.findall(r'self\._audit\(who, "([^"]+)"', source)) == set(AUDITED_ACTIONS)


def test_the_retention_answer_says_what_the_signed_heads_prove_where_they_are_kept():
    def signed(heads: str | None):
        def edit(raw):
            raw.setdefault("router", {})["records"] = {"audit_log": "/var/lib/kvrelay/audit.jsonl",
                                                       "audit_signing_key": "/etc/kvrelay/audit.key",
                                                       **({"audit_heads": heads} if heads else {})}
        return edit

    beside = _answer(_doc(signed(None)), "uni-on", Question.RETENTION)["answer"]
    assert "into /var/lib/kvrelay/audit.jsonl.heads" in beside and "each head numbered and signing the one before" \
        in beside
    assert "That heads file is beside the log: whoever can write both can cut its last heads" in beside
    apart = _answer(_doc(signed("/mnt/collector/audit.heads")), "uni-on", Question.RETENTION)["answer"]
    assert "into /mnt/collector/audit.heads" in apart and "beside the log" not in apart
    unsigned = _answer(_doc(), "uni-on", Question.RETENTION)["answer"]
    assert "The log's head is not signed (router.records.audit_signing_key is not set)" in unsigned


def test_the_access_answer_says_whom_the_routers_etcd_and_postgresql_admit():
    def routers(endpoints: bool):
        def edit(raw):
            raw["routers"] = [{"name": "qc", "site": "montreal"}, {"name": "ont", "site": "toronto"}]
            if endpoints:
                raw["etcd"] = {"endpoints": ["etcd.example:2379"]}
                raw["postgres"] = {"endpoints": ["pg.example:5432"]}
        return edit

    ours = _answer(_doc(routers(False)), "uni-on", Question.ACCESS)
    etcd, pg = ours["facts"]["shared_stores"]["etcd"], ours["facts"]["shared_stores"]["postgres"]
    assert etcd["admits"].startswith("the routers' certificates only") and "refused" in etcd["revoked_certificates"]
    assert pg["holds"] == "every tenant's batch jobs: prompts and outputs" and "refused" in pg["revoked_certificates"]
    assert "The routers share state in etcd (started by kvrelay serve at montreal" in ours["answer"]
    theirs = _answer(_doc(routers(True)), "uni-on", Question.ACCESS)["facts"]["shared_stores"]
    assert theirs["etcd"]["servers"] == ["etcd.example:2379"] and NOT_RECORDED in theirs["etcd"]["admits"]
    assert theirs["postgres"]["revoked_certificates"].startswith(NOT_RECORDED) and "kvrelay stores crl" in \
        theirs["postgres"]["revoked_certificates"]
    assert "shared_stores" not in _answer(_doc(), "uni-on", Question.ACCESS)["facts"]
