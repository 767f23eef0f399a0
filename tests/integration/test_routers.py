"""A deployment with three routers, one per site, sharing a real 3-member etcd
on loopback (each member's certificate from the cluster CA), and real workers
at one site: every router places on workers another registered and sees
their prefix-cache events; losing one etcd member changes nothing; losing
all of them leaves the routers serving with what they knew, refusing new
workers and saying so, until etcd is back; a router killed leaves the list
and rejoins when restarted. And the errors of a router that cannot reach its
etcd, or whose certificate its etcd does not trust."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from kvrelay.benchmarks.replay import ReplayConfig, replay
from kvrelay.benchmarks.traces import SAMPLE_AZURE, build_prompts, load_trace
from kvrelay.launch.credentials import ClusterCredentials
from kvrelay.launch.local import LocalCluster
from kvrelay.launch.postgres import installed as postgres_installed
from kvrelay.router.core.shared_jobs import JobStoreUnavailable, SharedJobStore, conninfo
from kvrelay.runtime.addresses import free_port
from kvrelay.runtime.config import TLSSection, dump_config, parse_config
from kvrelay.runtime.etcd import EtcdClient, EtcdError
from kvrelay.runtime.pki import CertRole, Identity, write_private
from kvrelay.runtime.rpc import Dialer
from kvrelay.runtime.tokens import token_sha256
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from tests.integration.helpers import tls_context, wait_until

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None,
                                 reason="etcd is not installed (make etcd, as root: Debian's etcd-server)"),
              pytest.mark.skipif(not postgres_installed(),
                                 reason="PostgreSQL is not installed (make postgres, as root: postgresql-15)")]

ROUTERS = {"qc": ("montreal", "CA-QC"), "ont": ("toronto", "CA-ON"), "bc": ("vancouver", "CA-BC")}
TOKENS = {"anywhere": "token-of-a-tenant-with-no-jurisdiction-0123456789", "lab-qc": "token-of-lab-qc-0123456789abcdef",
          "metered": "token-of-a-tenant-with-6-requests-a-minute", "single": "token-of-a-tenant-one-at-a-time-0"}
"""Tenants: one that may enter anywhere, one whose prompts may enter only in CA-QC."""
KVRELAY = [sys.executable, "-m", "kvrelay.cli"]
SECRET_PROMPT = "the-lab-qc-prompt-that-must-not-be-read-in-ontario"


def three_routers() -> dict:
    return {
        "router": {"port": 0, "http_port": None, "liveness": {"heartbeat_interval_s": 0.25},
                   "placement": {"policy": "least_loaded", "colocate_below_tokens": 0}},
        "routers": [{"name": n, "site": s} for n, (s, _) in ROUTERS.items()],
        "etcd": {"lease_ttl_s": 2},
        "sites": [{"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                  *({"name": s, "jurisdiction": j, "prefill": {"replicas": 0}, "decode": {"replicas": 0}}
                    for s, j in list(ROUTERS.values())[1:])],
        "workers": {"threads": 1},
        "cache": {"memory_gib": 0.25},
        "tenants": [{"name": "anywhere", "token_sha256": token_sha256(TOKENS["anywhere"])},
                    {"name": "lab-qc", "token_sha256": token_sha256(TOKENS["lab-qc"]), "jurisdictions": ["CA-QC"],
                     "log_prompts": True},
                    {"name": "metered", "token_sha256": token_sha256(TOKENS["metered"]), "requests_per_minute": 6},
                    {"name": "single", "token_sha256": token_sha256(TOKENS["single"]), "max_concurrent": 1}],
    }


@pytest.fixture(scope="module")
def routers(plumbing_model):
    lc = LocalCluster(parse_config(three_routers()), plumbing_model)
    lc.start()
    yield lc
    lc.stop()


def generate(lc: LocalCluster, router: str, ids: list[int] | None = None, tenant: str = "anywhere") -> ipb.Finish:
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids or [5, 6, 7, 8]), max_tokens=2, ignore_eos=True)
    with lc.dialer(TOKENS[tenant]).sync(lc.routers[router].address) as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=60))
    return msgs[-1].finish


def status(lc: LocalCluster, router: str) -> wpb.ListWorkersResponse:
    with lc.operator_dialer.sync(lc.routers[router].address) as ch:
        return wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)


def live_routers(lc: LocalCluster, router: str) -> list[str]:
    with lc.dialer().sync(lc.routers[router].address) as ch:  # no credentials: clients ask before choosing
        return [r.name for r in igrpc.InferenceStub(ch).ListRouters(ipb.ListRoutersRequest(), timeout=10).routers]


def test_every_router_places_on_workers_another_registered(routers):
    with routers.dialer().sync(routers.routers["ont"].address) as ch:
        listed = igrpc.InferenceStub(ch).ListRouters(ipb.ListRoutersRequest(), timeout=10)
    assert listed.answered_by == "ont"
    assert {(r.name, r.site, r.jurisdiction) for r in listed.routers} == {(n, s, j) for n, (s, j) in ROUTERS.items()}
    assert {r.address for r in listed.routers} == {r.address for r in routers.routers.values()}
    # the montreal workers registered with qc (their site's router); toronto's and vancouver's place on them
    for name in ROUTERS:
        fin = generate(routers, name)
        assert fin.reason == ipb.FINISH_REASON_LENGTH
        assert (fin.placement.prefill_worker, fin.placement.decode_worker) == ("montreal/prefill/0",
                                                                               "montreal/decode/0")
        st = status(routers, name)
        assert st.router_name == name and "reached; 3 router(s) live" in st.coordination
        assert sorted((w.info.worker_id, w.healthy) for w in st.workers) == [("montreal/decode/0", True),
                                                                             ("montreal/prefill/0", True)]


def test_every_router_receives_every_workers_prefix_cache_events(routers):
    generate(routers, "qc", list(range(100, 100 + 16 * 6)))  # six full blocks cached by qc's request

    def cached(router: str) -> int:
        workers = status(routers, router).workers
        return next(w.cached_blocks for w in workers if w.info.worker_id == "montreal/prefill/0")

    assert wait_until(lambda: cached("qc") >= 6, 10)
    assert wait_until(lambda: cached("ont") == cached("qc") == cached("bc"), 10)


def test_losing_one_etcd_member_changes_nothing(routers):
    routers.etcd.kill(0)
    try:
        for name in ROUTERS:
            assert generate(routers, name).reason == ipb.FINISH_REASON_LENGTH
        assert wait_until(lambda: all("reached" in status(routers, n).coordination for n in ROUTERS), 10)
        assert live_routers(routers, "bc") == ["bc", "ont", "qc"]
    finally:
        routers.etcd.restart(0)


def register_stranger(lc: LocalCluster, router: str) -> None:
    """A registration with a real worker certificate for a worker nobody started."""
    ident = Identity("montreal", CertRole.PREFILL, "9")
    dialer = Dialer(lc.creds.material(ident))
    site = ROUTERS[router][0]
    info = wpb.WorkerInfo(worker_id=ident.path, role=wpb.ROLE_PREFILL, site="montreal", address="127.0.0.1:9")
    with dialer.sync(lc.routers[router].internal, server_name=Identity(site, CertRole.ROUTER, router).dns) as ch:
        stub = wgrpc.RegistryStub(ch)
        stub.Register(wpb.RegisterRequest(info=info), timeout=20)
        stub.Deregister(wpb.DeregisterRequest(worker_id=ident.path), timeout=20)


def test_without_etcd_routers_serve_what_they_know_and_refuse_new_workers(routers):
    for i in range(3):
        routers.etcd.kill(i)
    try:
        assert wait_until(lambda: all("UNREACHABLE" in status(routers, n).coordination for n in ROUTERS), 15)
        assert "serving the last known membership" in status(routers, "ont").coordination
        for name in ROUTERS:
            assert generate(routers, name).reason == ipb.FINISH_REASON_LENGTH
        with pytest.raises(grpc.RpcError) as refused:
            register_stranger(routers, "ont")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shared store is unreachable" in refused.value.details()
    finally:
        for i in range(3):
            routers.etcd.restart(i)
    assert wait_until(lambda: all("reached" in status(routers, n).coordination for n in ROUTERS), 30)
    register_stranger(routers, "ont")  # etcd is back: new workers are taken again
    assert wait_until(lambda: all(len(status(routers, n).workers) == 2 for n in ROUTERS), 10)


def test_a_killed_router_leaves_the_list_and_rejoins(routers):
    routers.stop_router("bc")  # SIGKILL: its lease lapses after lease_ttl_s
    assert wait_until(lambda: live_routers(routers, "qc") == ["ont", "qc"], 15)
    assert generate(routers, "ont").reason == ipb.FINISH_REASON_LENGTH
    routers.restart_router(name="bc")
    assert wait_until(lambda: live_routers(routers, "qc") == ["bc", "ont", "qc"], 15)
    assert wait_until(lambda: sum(w.healthy for w in status(routers, "bc").workers) == 2, 15)
    assert generate(routers, "bc").placement.decode_worker == "montreal/decode/0"


def test_a_stream_cut_by_its_routers_death_resumes_at_another(routers):
    """`kvrelay generate` given two routers: the first is killed mid-answer; the client resumes at the
    second from the tokens it has (resume_token_ids), and the whole answer is the uninterrupted one."""
    r = routers.routers
    argv = ["generate", "--max-tokens", "300", "--ignore-eos", "--verbose", "Tell me about the rivers of Quebec."]
    reference = cli(routers, "anywhere", *argv, "--router", r["qc"].address)
    assert reference.returncode == 0, reference.stderr
    env = {**os.environ, "KVRELAY_API_KEY": TOKENS["anywhere"]}
    proc = subprocess.Popen([*KVRELAY, *argv, "--router", f"{r['bc'].address},{r['qc'].address}", "--ca",
                             str(routers.ca_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first = os.read(proc.stdout.fileno(), 1)  # the answer has started, at bc (unbuffered: nothing held back)
        routers.stop_router("bc")
        rest, raw_err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        routers.restart_router(name="bc")
    err = raw_err.decode()
    assert proc.returncode == 0, err
    assert "went away after" in err and f"resuming at {r['qc'].address}" in err
    assert (first + rest).decode() == reference.stdout  # nothing lost, nothing repeated
    assert "+ 300 tokens;" in err  # the finish counts the whole answer
    assert wait_until(lambda: live_routers(routers, "qc") == ["bc", "ont", "qc"], 15)


def kill_when_busy(lc: LocalCluster, router: str, timeout_s: float = 60.0) -> None:
    """SIGKILL ``router`` once it has requests on workers (a replay reached it), a moment later (some of
    their streams have started)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if any(w.inflight for w in status(lc, router).workers):
                time.sleep(0.3)
                break
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    lc.stop_router(router)


def test_a_replay_loses_nothing_when_a_router_is_killed(routers):
    """A trace replayed across the three routers (each request to one in turn); one router is killed with
    SIGKILL mid-replay: every request ends with its whole answer (those it cut resumed at the next router)."""
    reqs = load_trace(SAMPLE_AZURE, "azure", 24)
    prompts = build_prompts(reqs, 0.02, (200, 40_000), seed=3, out_scale=1.0)
    for p in prompts:
        p.max_tokens = 200  # streams long enough to be cut
    cfg = ReplayConfig(speedup=8.0, progress=False, request_timeout_s=180)
    killer = threading.Thread(target=kill_when_busy, args=(routers, "ont"))
    killer.start()
    try:
        records, _ = asyncio.run(replay(routers.addresses, prompts, cfg, routers.dialer(TOKENS["anywhere"]),
                                        routers.operator_dialer))
    finally:
        killer.join()
        routers.restart_router(name="ont")
    assert [r.error for r in records if r.error] == []
    assert all(len(r.token_ids) == 200 for r in records)  # whole answers, none cut short
    assert sum(r.router_moves for r in records) >= 1  # the killed router had requests: they moved on
    print(f"moved {sum(r.router_moves for r in records)}, resumed {sum(r.router_resumes for r in records)}")
    assert wait_until(lambda: live_routers(routers, "qc") == ["bc", "ont", "qc"], 15)


def test_a_job_continues_at_the_other_routers_when_its_router_dies(routers, tmp_path):
    """A job submitted at bc, which runs some of its requests; bc is killed: the requests it held are
    taken back within 15 s (its etcd lease ended) and run at the others; every result is stored once
    (read at qc), the standby holds them, and `kvrelay job results --follow` given bc then qc follows
    on at qc, writing each result once."""
    n = 24
    reqs = [ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6, 7, 10 + i]), max_tokens=30, ignore_eos=True)
            for i in range(n)]
    with routers.dialer(TOKENS["anywhere"]).sync(routers.routers["bc"].address) as ch:
        job = jgrpc.JobsStub(ch).SubmitJob(jpb.SubmitJobRequest(name="survives", requests=reqs), timeout=60)
    pg = routers.postgres
    assert pg is not None
    held = f"SELECT count(*) FROM items WHERE job = '{job.id}' AND holder = 'bc'"
    assert wait_until(lambda: pg.replayed(0, held) != "0", 60)  # bc runs some of them
    r = routers.routers
    out, err_file = tmp_path / "results.jsonl", tmp_path / "follower.err"
    with out.open("w") as out_f, err_file.open("w") as err_f:  # files: nothing buffered between two readers
        follower = subprocess.Popen([*KVRELAY, "job", "results", "--follow", "--router", f"{r['bc'].address},"
                                     f"{r['qc'].address}", "--ca", str(routers.ca_file), job.id], stdout=out_f,
                                    stderr=err_f, env={**os.environ, "KVRELAY_API_KEY": TOKENS["anywhere"]})
    try:
        assert wait_until(lambda: out.read_text().count("\n") >= 1, 60)  # following at bc: a result came
        routers.stop_router("bc")  # SIGKILL
        killed = time.monotonic()
        assert wait_until(lambda: pg.replayed(0, held) == "0", 15)  # taken back: they run at qc and ont
        taken_back_s = time.monotonic() - killed
        with routers.dialer(TOKENS["anywhere"]).sync(r["qc"].address) as ch:
            results = list(jgrpc.JobsStub(ch).JobResults(jpb.JobResultsRequest(id=job.id, follow=True),
                                                         timeout=240))
        follower.wait(60)
    finally:
        follower.kill()
        routers.restart_router(name="bc")
    err = err_file.read_text()
    assert follower.returncode == 0, err
    assert "went away after" in err and f"following the job at {r['qc'].address}" in err
    assert sorted(json.loads(line)["index"] for line in out.read_text().splitlines()) == list(range(n))  # once each
    assert sorted(r.index for r in results) == list(range(n))  # every result, once
    assert [r.error for r in results if r.error] == []
    assert all(len(r.token_ids) == 30 for r in results)
    numbered = f"SELECT count(DISTINCT seq) || '/' || max(seq) FROM items WHERE job = '{job.id}'"
    assert pg.replayed(0, numbered) == f"{n}/{n}"  # each stored once: no result numbered twice or skipped
    assert wait_until(lambda: pg.replayed(1, numbered) == f"{n}/{n}", 10)  # and on the standby
    print(f"bc's requests taken back {taken_back_s:.1f} s after its death")
    assert wait_until(lambda: live_routers(routers, "qc") == ["bc", "ont", "qc"], 15)


@pytest.mark.parametrize("problem", ["unreachable", "foreign CA"])
def test_a_router_that_cannot_use_its_etcd_exits_naming_it(routers, plumbing_model, tmp_path, problem):
    raw = three_routers()
    for r in raw["routers"]:  # any free ports: the defaults (50051, 50052) may be bound by a test beside this one
        r |= {"port": 0, "internal_port": 0, "http_port": None}
    cfg = parse_config(raw)
    endpoint = f"127.0.0.1:{free_port()}" if problem == "unreachable" else routers.etcd.endpoints[1]
    cfg.etcd.endpoints, cfg.etcd.timeout_s = [endpoint], 2.0
    cfg.postgres.endpoints = routers.cfg.postgres.endpoints
    cfg.router.records.audit_log = str(tmp_path / "audit.jsonl")
    path = tmp_path / "cluster.yaml"
    dump_config(cfg, path)
    creds = routers.creds if problem == "unreachable" else ClusterCredentials.for_config(TLSSection(), tmp_path / "ca")
    assert creds is not None
    env = {**os.environ, **creds.env(Identity("toronto", CertRole.ROUTER, "ont"), ("127.0.0.1",)),
           "KVRELAY_KV_SECRET": "ab" * 32}
    proc = subprocess.run([sys.executable, "-m", "kvrelay.router", "--config", str(path), "--name", "ont",
                           "--model-path", str(plumbing_model)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"router ont: could not reach etcd within 2 s: etcd: {endpoint}:" in proc.stderr
    assert ("UNAVAILABLE" if problem == "unreachable" else "TLS refused") in proc.stderr


def audit_of(lc: LocalCluster, router: str) -> str:
    audit = Path(lc.cfg.router.records.audit_log or "")
    return (audit.parent / f"{audit.stem}.{router}{audit.suffix}").read_text()


def test_a_tenant_pinned_to_qc_is_refused_unread_in_ontario_and_served_in_quebec(routers):
    req = ipb.GenerateRequest(prompt=SECRET_PROMPT, max_tokens=2)
    with routers.dialer(TOKENS["lab-qc"]).sync(routers.routers["ont"].address) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            list(igrpc.InferenceStub(ch).Generate(req, timeout=30))
        listed = igrpc.InferenceStub(ch).ListRouters(ipb.ListRoutersRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "may enter only in {CA-QC}; this router (ont) is at toronto (CA-ON) and did not read" in \
        refused.value.details()
    assert f"qc (montreal, CA-QC) at {routers.routers['qc'].address}" in refused.value.details()
    assert list(listed.yours) == ["qc"]  # what its clients ask first
    with routers.dialer(TOKENS["lab-qc"]).sync(routers.routers["qc"].address) as ch:
        out = list(igrpc.InferenceStub(ch).Generate(req, timeout=60))
    assert out[-1].finish.placement.decode_worker == "montreal/decode/0"
    assert wait_until(lambda: SECRET_PROMPT in audit_of(routers, "qc"), 10)  # its router logs it (log_prompts)
    on = audit_of(routers, "ont")
    assert SECRET_PROMPT not in on  # refused unread: nothing of it in this router's log
    refusals = [r for r in map(json.loads, on.splitlines()) if r["kind"] == "refusal"]
    assert [(r["tenant"], r["router"], r["outcome"]) for r in refusals] == [("lab-qc", "ont", "failed_precondition")]


def test_a_qc_tenants_job_runs_and_is_read_only_in_quebec(routers):
    """Issue 56, finding 1: a CA-QC tenant's job submitted at qc. Every router's job runner polls the
    shared store, but ont and bc never take its requests (their audit logs hold no record of the
    tenant's requests and none of its prompts; while it ran, no request of it was held by them), and
    every Jobs call of the tenant there is refused unread, naming qc. (Before: ont and bc took
    and ran some of its requests, logging their prompts, and read its results to anyone.)"""
    n = 12
    secret = "a-lab-qc-job-prompt-that-stays-in-quebec"
    reqs = [ipb.GenerateRequest(prompt=f"{secret} {i}", max_tokens=6, ignore_eos=True) for i in range(n)]
    with routers.dialer(TOKENS["lab-qc"]).sync(routers.routers["qc"].address) as ch:
        job = jgrpc.JobsStub(ch).SubmitJob(jpb.SubmitJobRequest(name="qc-only", requests=reqs), timeout=60)
        pg, holders = routers.postgres, set()
        assert pg is not None
        held = f"SELECT string_agg(DISTINCT holder, ',') FROM items WHERE job = '{job.id}'"
        end = time.monotonic() + 120
        while jgrpc.JobsStub(ch).GetJob(jpb.GetJobRequest(id=job.id), timeout=10).state != jpb.JOB_STATE_DONE:
            assert time.monotonic() < end, "the job did not finish within 120 s"
            holders |= set(filter(None, pg.replayed(0, held).split(",")))
            time.sleep(0.05)
        results = list(jgrpc.JobsStub(ch).JobResults(jpb.JobResultsRequest(id=job.id), timeout=60))
    assert sorted(r.index for r in results) == list(range(n)) and [r.error for r in results if r.error] == []
    assert holders <= {"qc"}, holders
    assert wait_until(lambda: audit_of(routers, "qc").count(secret) >= n, 10)  # logged where it ran
    for name in ("ont", "bc"):
        with routers.dialer(TOKENS["lab-qc"]).sync(routers.routers[name].address) as ch:
            stub = jgrpc.JobsStub(ch)
            calls = [("GetJob", jpb.GetJobRequest(id=job.id)), ("JobResults", jpb.JobResultsRequest(id=job.id)),
                     ("ListJobs", jpb.ListJobsRequest()), ("SubmitJob", jpb.SubmitJobRequest(requests=reqs[:1])),
                     ("DeleteJob", jpb.DeleteJobRequest(id=job.id))]
            for what, msg in calls:
                with pytest.raises(grpc.RpcError) as refused:
                    list(getattr(stub, what)(msg, timeout=10)) if what == "JobResults" else \
                        getattr(stub, what)(msg, timeout=10)
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, what
                assert f"this router ({name})" in refused.value.details() and "qc (montreal, CA-QC)" in \
                    refused.value.details(), what
        log = audit_of(routers, name)
        assert secret not in log
        ran = [r for r in map(json.loads, log.splitlines()) if r.get("tenant") == "lab-qc" and r["kind"] != "refusal"]
        assert ran == [], ran[:2]


def test_a_stream_resumes_only_with_its_ticket_and_what_it_resumes_is_audited(routers):
    """Issue 56, finding 5: resume_token_ids without the stream's ticket, or with a ticket for other
    tokens, are refused PERMISSION_DENIED before anything is computed (before: a two-token prompt with
    390 made-up "received" tokens was served, charged two tokens and audited without them); the
    stream's own ticket resumes it, and the record counts and (log_prompts) logs what it resumed."""
    prompt = "a-lab-qc-stream-that-resumes"
    req = ipb.GenerateRequest(prompt=prompt, max_tokens=30, ignore_eos=True)
    ids: list[int] = []
    ticket = b""
    with routers.dialer(TOKENS["lab-qc"]).sync(routers.routers["qc"].address) as ch:
        call = igrpc.InferenceStub(ch).Generate(req, timeout=60)
        for msg in call:
            ids += msg.token_ids
            ticket = msg.resume_ticket or ticket
            if len(ids) >= 8:
                break
        call.cancel()
        stub = igrpc.InferenceStub(ch)
        attacks = {"need the resume_ticket": ipb.GenerateRequest(prompt=prompt, max_tokens=400, ignore_eos=True,
                                                                 resume_token_ids=[7] * 390),
                   "does not match": ipb.GenerateRequest(prompt=prompt, max_tokens=30, ignore_eos=True,
                                                         resume_token_ids=[*ids, 7], resume_ticket=ticket)}
        for why, attack in attacks.items():
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(attack, timeout=30))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and why in refused.value.details()
        resumed = ipb.GenerateRequest(prompt=prompt, max_tokens=30, ignore_eos=True, request_id="resumed-stream",
                                      resume_token_ids=ids, resume_ticket=ticket)
        rest = list(stub.Generate(resumed, timeout=60))
    assert sum(len(m.token_ids) for m in rest) == 30 - len(ids) and rest[-1].finish.usage.completion_tokens == 30
    assert all(m.resume_ticket for m in rest if m.token_ids)

    def record():
        return next((r for r in map(json.loads, audit_of(routers, "qc").splitlines())
                     if r.get("request_id") == "resumed-stream"), None)

    assert wait_until(lambda: record() is not None, 10)
    rec = record()
    assert rec["resumed_tokens"] == len(ids) and rec["completion_tokens"] == 30 - len(ids)
    assert rec["resumed_output"] and rec["prompt"] == prompt


def etcd_as(lc: LocalCluster, ident: Identity) -> EtcdClient:
    """A client of the routers' etcd presenting a certificate of ``ident`` from the cluster CA."""
    assert lc.creds is not None
    return EtcdClient(lc.cfg.etcd.endpoints, Dialer(lc.creds.material(ident)), timeout_s=5.0)


def test_only_the_routers_certificates_may_use_etcd(routers):
    """Issue 56, finding 2 (a): a worker's, a tenant's and an operator's certificates, all from the
    cluster CA, are refused every read and write of the routers' keys (before: any of them could drain
    every worker or delete a live router's key); the routers go on as before."""
    prefix = routers.cfg.etcd.prefix
    attackers = [Identity("montreal", CertRole.DECODE, "0"), Identity("montreal", CertRole.CLIENT, "anywhere"),
                 Identity("montreal", CertRole.OPERATOR, "noc")]

    async def attempts(ident: Identity) -> dict[str, str]:
        client, out = etcd_as(routers, ident), {}
        calls = {"drain a worker": lambda: client.put(f"{prefix}drains/montreal/decode/0", b""),
                 "hide a router": lambda: client.delete(f"{prefix}routers/qc"),
                 "forge quotas": lambda: client.put(f"{prefix}quotas/ont", b'{"metered": [9999, 0, 0, 0]}'),
                 "read the workers": lambda: client.get_prefix(f"{prefix}workers/")}
        try:
            for what, call in calls.items():
                try:
                    await call()
                    out[what] = "done"
                except EtcdError as exc:
                    out[what] = str(exc)
        finally:
            await client.close()
        return out

    for ident in attackers:
        out = asyncio.run(attempts(ident))
        assert all("PERMISSION_DENIED" in why for why in out.values()), (ident, out)
    assert live_routers(routers, "bc") == ["bc", "ont", "qc"]
    assert generate(routers, "ont").placement.decode_worker == "montreal/decode/0"  # not drained


def test_values_in_etcd_are_checked_and_the_watch_goes_on(routers):
    """Issue 56, finding 2 (b-d), with a router's certificate (the only kind etcd admits): a value that
    does not parse, a router the config lacks, a worker that puts itself in another site than its id's,
    a drain of no worker, a pool of no site, malformed and forged quota figures. Each router skips every
    one with an audit record and watches on: it still follows bc leaving and coming back, bc restarted
    over them joins, and the quota exchange goes on. (Before: the first bad value stopped every
    router's watch at its revision for ever, and a router started after it crashed.)"""
    prefix = routers.cfg.etcd.prefix
    evil = wpb.WorkerInfo(worker_id="toronto/decode/evil", site="montreal", role=wpb.ROLE_DECODE,
                          address="127.0.0.1:1", kv_endpoint="127.0.0.1:2")
    bad = {"workers/montreal/decode/9": b"\xff\xff\xff not a WorkerInfo",
           "routers/ghost": ipb.RouterPeer(name="ghost", site="montreal", address="127.0.0.1:1",
                                           internal_address="127.0.0.1:2").SerializeToString(),
           "workers/toronto/decode/evil": evil.SerializeToString(),
           "drains/nobody": b"",
           "pools/atlantis/decode": b"5",
           "quotas/bc": b'{"metered": ["a", "b", "c"]}',
           "quotas/ghost": b'{"metered": [9999, 0, 0, 0]}'}

    async def write(values: dict[str, bytes | None]) -> int:
        client = etcd_as(routers, Identity("montreal", CertRole.ROUTER, "qc"))
        try:
            for key, value in values.items():
                await (client.delete(prefix + key) if value is None else client.put(prefix + key, value))
            return (await client.get(f"{prefix}quotas/qc")).mod_revision
        finally:
            await client.close()

    try:
        before = asyncio.run(write(bad))
        routers.restart_router(name="bc")  # it reads every bad value at start
        assert wait_until(lambda: live_routers(routers, "qc") == ["bc", "ont", "qc"], 30)
        assert wait_until(lambda: asyncio.run(write({})) > before, 10)  # qc's quota exchange writes on
        for name in ("qc", "ont", "bc"):
            def refused(name=name):
                return {r["key"].removeprefix(prefix) for r in map(json.loads, audit_of(routers, name).splitlines())
                        if r["kind"] == "shared_value"}
            assert wait_until(lambda: set(bad) - {"quotas/bc"} <= refused(), 10), (name, refused())
            assert "toronto/decode/evil" not in {w.info.worker_id for w in status(routers, name).workers}
        records = [r for r in map(json.loads, audit_of(routers, "ont").splitlines()) if r["kind"] == "shared_value"]
        why = {r["key"].removeprefix(prefix): r["error"] for r in records}
        assert "must be <site>/<role>/<name> with site 'montreal'" in why["workers/toronto/decode/evil"]
        assert "not one of the config's routers" in why["routers/ghost"]
        assert "does not parse" in why["workers/montreal/decode/9"]
        assert generate(routers, "ont").placement.decode_worker == "montreal/decode/0"
    finally:
        asyncio.run(write({k: None for k in bad if not k.startswith("quotas/bc")}))


def test_revoking_a_router_certificate_ends_its_etcd_and_postgresql_connections(routers):
    """The launcher's path for a serial newly revoked (issue 56, finding 3): the revocation list
    rewritten in every server's folder, PostgreSQL's sessions of the serial ended, etcd's members
    restarted one at a time. A stolen router certificate connected to both loses both; the three
    routers serve on through the rolling restart."""
    assert routers.creds is not None and routers.postgres is not None
    stolen = routers.creds.material(Identity("montreal", CertRole.ROUTER, "qc"))
    assert stolen.cert_pem is not None
    serial = x509.load_pem_x509_certificate(stolen.cert_pem).serial_number
    pg = routers.postgres
    sessions = f"SELECT count(*) FROM pg_stat_ssl WHERE client_serial = {serial}"
    folder = Path(routers._tmp.name) / "stolen"
    folder.mkdir()
    files = [folder / n for n in ("ca.pem", "cert.pem", "key.pem")]
    for path, pem in zip(files, (stolen.ca_pem, stolen.cert_pem, stolen.key_pem), strict=True):
        write_private(path, pem)
    store = SharedJobStore(conninfo(routers.cfg.postgres.endpoints, routers.cfg.postgres.database,
                                    routers.cfg.postgres.user, tuple(map(str, files))), "stolen", "pg", 5.0)

    async def etcd_put(client: EtcdClient) -> str:
        try:
            await client.put(f"{routers.cfg.etcd.prefix}drains/montreal/decode/9", b"")
            return "written"
        except EtcdError as exc:
            return str(exc)

    async def scenario() -> tuple[str, str]:
        client = EtcdClient(routers.cfg.etcd.endpoints, Dialer(stolen), timeout_s=5.0)
        try:
            before = await client.get_prefix(f"{routers.cfg.etcd.prefix}routers/")
            assert len(before[0]) == 3
            store.list()
            assert pg.replayed(0, sessions) == "1"
            routers.creds.revoked = routers.creds.revoked | {serial}
            await asyncio.to_thread(routers._revoke_at_stores, frozenset({serial}))
            return await etcd_put(client), pg.replayed(0, sessions)
        finally:
            await client.close()

    try:
        etcd_after, sessions_after = asyncio.run(scenario())
        assert etcd_after != "written" and sessions_after == "0"
        with pytest.raises(JobStoreUnavailable):
            store.list()
        assert wait_until(lambda: live_routers(routers, "bc") == ["bc", "ont", "qc"], 30)
        assert generate(routers, "ont").placement.decode_worker == "montreal/decode/0"
    finally:
        store.close()
        routers.creds.revoked = routers.creds.revoked - {serial}
        asyncio.run(asyncio.to_thread(routers._revoke_at_stores, frozenset()))


def test_http_refuses_before_the_body(routers):
    """A body that never comes: the answer comes anyway, so the router did not wait to read it."""
    host, port = routers.routers["ont"].http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            tls_context(routers).wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['lab-qc']}\r\n"
                   "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n{\"prompt\": \"").encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, f"the router closed without a whole answer: {answer!r}"
            answer += chunk
    head, _, body = answer.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 400")
    err = json.loads(body)["error"]
    assert err["code"] == "failed_precondition" and "qc (montreal, CA-QC)" in err["message"]


def cli(lc: LocalCluster, tenant: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVRELAY_API_KEY": TOKENS[tenant]}
    return subprocess.run([*KVRELAY, *argv, "--ca", str(lc.ca_file)], capture_output=True, text=True, timeout=120,
                          env=env)


def test_the_client_chooses_a_router_in_its_jurisdiction(routers):
    r = routers.routers
    table = cli(routers, "lab-qc", "routers", "--router", r["ont"].address)
    assert table.returncode == 0, table.stderr
    reads = {line.split()[0]: line.split()[-1] for line in table.stdout.splitlines()[1:4]}
    assert reads == {"bc": "no", "ont": "no", "qc": "yes"}
    # the tenant's client is given every router, the one it may not use first, one that is down next
    nobody = f"127.0.0.1:{free_port()}"
    gen = cli(routers, "lab-qc", "generate", "--max-tokens", "2", "--verbose", "--router",
              f"{r['ont'].address},{nobody},{r['qc'].address}", "hello")
    assert gen.returncode == 0, gen.stderr
    assert "decode montreal/decode/0" in gen.stderr
    wrong = cli(routers, "lab-qc", "generate", "--router", f"{r['ont'].address},{r['bc'].address}", "hello")
    assert wrong.returncode != 0
    assert "none of the routers given reads this tenant's prompts" in wrong.stderr
    assert f"use qc (montreal, CA-QC) at {r['qc'].address}" in wrong.stderr


def scale(lc: LocalCluster, router: str, replicas: int) -> apb.ScaleResponse:
    with lc.operator_dialer.sync(lc.routers[router].address) as ch:
        return agrpc.AdminStub(ch).Scale(apb.ScaleRequest(site="montreal", role="decode", replicas=replicas),
                                         timeout=30)


def test_a_pool_scaled_at_one_router_is_scaled_at_every_router(routers):
    """Scaled down at on: every router stops placing on the worker it drains, which leaves once all of
    them say its requests are done; scaled up at bc: the launcher, which asks qc, starts one again."""
    drained = scale(routers, "ont", 0).draining
    assert list(drained) == ["montreal/decode/0"]

    def pools(router: str) -> tuple[int, list[str]]:
        with routers.operator_dialer.sync(routers.routers[router].address) as ch:
            p = next(p for p in agrpc.AdminStub(ch).ListPools(apb.ListPoolsRequest(), timeout=10).pools
                     if p.site == "montreal" and p.role == "decode")
        return p.desired, list(p.workers)

    assert wait_until(lambda: all(pools(n)[0] == 0 for n in ROUTERS), 10)
    assert wait_until(lambda: all("montreal/decode/0" not in (w.info.worker_id for w in status(routers, n).workers)
                                  for n in ROUTERS), 30)  # it left, and every router forgot it
    scale(routers, "bc", 1)
    assert wait_until(lambda: all(pools(n) == (1, ["montreal/decode/1"]) for n in ROUTERS), 90)
    assert generate(routers, "ont").placement.decode_worker == "montreal/decode/1"


def test_usage_is_the_same_at_every_router(routers):
    """Every router hears every worker's own counters, so each router's usage is the whole deployment's:
    the same totals at each (sum one router's, not all: none counts twice)."""
    for name in ROUTERS:
        generate(routers, name)

    def totals(router: str) -> dict[str, tuple[int, int, int]]:
        with routers.operator_dialer.sync(routers.routers[router].address) as ch:
            rows = agrpc.AdminStub(ch).Usage(apb.UsageRequest(by=["tenant"]), timeout=10).rows
        return {r.tenant: (r.requests, r.prompt_tokens, r.completion_tokens) for r in rows}

    assert wait_until(lambda: totals("qc") == totals("ont") == totals("bc"), 15), \
        [totals(n) for n in ROUTERS]
    assert totals("qc")["anywhere"][0] >= 3


def test_a_quota_holds_across_routers(routers):
    """6 requests a minute: 4 taken at qc leave about 2 at ont (each router alone would allow 6)."""
    for _ in range(4):
        generate(routers, "qc", tenant="metered")
    time.sleep(4.0)  # the routers exchange what they took every second (a loaded machine: a few rounds)
    admitted, refused = 0, None
    for _ in range(4):
        try:
            generate(routers, "ont", tenant="metered")
            admitted += 1
        except grpc.RpcError as exc:
            refused = exc
            break
    assert admitted in (1, 2, 3) and refused is not None, admitted  # 6 - 4, plus what refilled meanwhile
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_minute quota (6)" in refused.details()


def test_requests_in_progress_count_at_every_router(routers):
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6, 7]), max_tokens=4000, ignore_eos=True)
    refused = None
    with routers.dialer(TOKENS["single"]).sync(routers.routers["qc"].address) as ch:
        stream = igrpc.InferenceStub(ch).Generate(req, timeout=120)
        next(stream)  # started at qc
        end = time.monotonic() + 15
        while refused is None and time.monotonic() < end:  # bc learns of it within a few exchanges
            try:
                generate(routers, "bc", tenant="single")
                time.sleep(0.2)
            except grpc.RpcError as exc:
                refused = exc
        running = stream.running()  # the stream at qc was still going when bc refused
        stream.cancel()
    assert refused is not None and running
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent quota (1 requests in progress)" in refused.details()
