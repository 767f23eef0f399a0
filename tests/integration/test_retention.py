"""Retention and job deletion on a real SQLite job store and a real audit
log, with a clock moved ahead: tenant A's finished jobs and audit records
past its retention are deleted while tenant B's (kept longer) and running
jobs stay; every deletion is itself audited and the log still verifies; the
database is private (0600 in a 0700 folder) and keeps no deleted prompt.
``DeleteJob`` over a real gRPC server, with a stand-in for the router core
whose requests run until cancelled: only the owner may delete, a running job
is stopped first, and a deletion that cannot be audited is not done."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import stat
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvrelay.router.core.jobs_store import JOB_CANCELLED, JOB_DONE, JOB_QUEUED, JOB_RUNNING, JobStore
from kvrelay.router.core.records import RecordKind
from kvrelay.router.frontends.jobs import JobService
from kvrelay.router.governance.audit import AuditLog, query, verify
from kvrelay.router.governance.retention import DAY_S, RetentionSweeper
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc
from tests.integration.helpers import JobGates, jobs_server

CONFIG = {
    "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}],
    "router": {"records": {"operator_audit_retention_days": 30, "retention_sweep_s": 0.05}},
    "tenants": [{"name": "a", "job_retention_days": 1, "audit_retention_days": 2},
                {"name": "b", "job_retention_days": 10, "audit_retention_days": 20}],
}
SECRET = b"SECRET-PROMPT-4f1c"


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def _finished_job(store: JobStore, owner: str, n: int = 3, secret: bytes = b"r", check: bool = True) -> str:
    """A job of ``n`` requests, run and finished now (real time, as the router stamps it)."""
    job = store.submit(f"{owner}-done", [secret + bytes([i]) for i in range(n)], owner).id
    claimed = store.claim(100)
    assert {(j, i) for j, i, _, _ in claimed} == {(job, i) for i in range(n)}
    for i in range(n):
        assert store.finish(job, i, secret + b"-result", True)
    assert not check or store.state(job) == JOB_DONE
    return job


@pytest.fixture
def world(tmp_path: Path):
    """Config, the router's job store with jobs of a, b and no tenant, the sweeper's own store, an audit log."""
    cfg = parse_config(CONFIG)
    db = tmp_path / "state" / "jobs.sqlite"
    store = JobStore(db)
    jobs = {"a": _finished_job(store, "a", secret=SECRET), "b": _finished_job(store, "b"),
            "": _finished_job(store, "")}
    jobs["a-running"] = store.submit("a-running", [b"x", b"y"], "a").id
    store.claim(1)
    jobs["a-queued"] = store.submit("a-queued", [b"z"], "a").id
    cancelled = store.submit("a-cancelled", [b"c"] * 2, "a").id
    store.cancel(cancelled)
    jobs["a-cancelled"] = cancelled
    clock = Clock()
    audit = AuditLog(tmp_path / "state" / "audit.jsonl", clock=clock, fsync=False)
    for i in range(6):
        audit.append(RecordKind.REQUEST, {"tenant": "a" if i % 2 else "b", "request_id": f"r{i}"})
    audit.append(RecordKind.OPERATOR, {"operator": "ops", "action": "scale"})
    sweeper = RetentionSweeper(cfg, JobStore(db), audit, clock=clock)
    yield cfg, store, jobs, audit, sweeper, clock
    store.close()
    sweeper.jobs.close()
    audit.close()


def _states(store: JobStore, jobs: dict[str, str]) -> dict[str, int | None]:
    return {k: store.state(v) for k, v in jobs.items()}


def test_a_past_retention_b_kept_running_kept_and_deletion_audited(world):
    _cfg, store, jobs, audit, sweeper, clock = world
    assert sweeper.sweep_once().empty  # nothing is old yet
    clock.t += 5 * DAY_S  # past a's retention of jobs (1 day) and audit records (2 days); not b's
    report = sweeper.sweep_once()
    assert report.jobs_deleted == {"a": 2} and report.requests_deleted == {"a": 5}
    assert report.audit_records_deleted == {"a": 3}
    states = _states(store, jobs)
    assert states["a"] is None and states["a-cancelled"] is None  # done and cancelled: gone
    assert states["b"] == JOB_DONE and states[""] == JOB_DONE  # b keeps 10 days, no tenant 30 (the default)
    assert states["a-running"] == JOB_RUNNING and states["a-queued"] == JOB_QUEUED  # unfinished: never
    rows = store.db.execute("SELECT COUNT(*) FROM items WHERE job IN (?, ?)", (jobs["a"], jobs["a-cancelled"]))
    assert rows.fetchone()[0] == 0  # requests and results too
    expired = [r for r in query(audit.path, kind="job")]
    assert {(r["action"], r["job"], r["tenant"], r["requests_deleted"]) for r in expired} == {
        ("expired", jobs["a"], "a", 3), ("expired", jobs["a-cancelled"], "a", 2)}
    retention = list(query(audit.path, kind="retention"))
    assert len(retention) == 1 and retention[0]["counts"] == {"a": 3}
    assert [r["request_id"] for r in query(audit.path, kind="request")] == ["r0", "r2", "r4"]  # b's
    assert verify(audit.path).ok
    clock.t += 40 * DAY_S  # now everything finished is old, and every record but the newest ones
    report = sweeper.sweep_once()
    assert report.jobs_deleted == {"b": 1, "": 1}
    assert _states(store, jobs)["a-running"] == JOB_RUNNING
    result = verify(audit.path)
    assert result.ok, result.problem
    kept = [r["kind"] for r in query(audit.path)]
    assert "request" not in kept and "operator" not in kept and kept.count("job") == 2  # this sweep's own
    assert kept[-1] == "retention"


def test_the_database_is_private_and_keeps_no_deleted_prompt(world):
    _cfg, store, _jobs, _audit, sweeper, clock = world
    db = Path(store.db.execute("PRAGMA database_list").fetchone()[2])
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    for f in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        assert f.exists() and stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert any(SECRET in f.read_bytes() for f in (db, Path(f"{db}-wal")))
    clock.t += 5 * DAY_S
    sweeper.sweep_once()
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for f in (db, Path(f"{db}-wal")):
        assert SECRET not in f.read_bytes(), f  # overwritten, not left in a free page


def test_an_old_database_file_is_made_private(tmp_path):
    db = tmp_path / "jobs.sqlite"
    sqlite3.connect(db).close()
    db.chmod(0o644)
    JobStore(db).close()
    assert stat.S_IMODE(db.stat().st_mode) == 0o600


def test_the_sweeper_may_share_the_jobs_store_with_its_thread(world):
    """As the router does: the Jobs service's thread submits and finishes
    jobs on the store while the sweeper deletes through the same one."""
    _cfg, store, jobs, audit, sweeper, clock = world
    sweeper.jobs.close()
    sweeper.jobs = store
    store.cancel(jobs["a-running"])  # its request left running: kept; the queued one is finished now
    store.cancel(jobs["a-queued"])
    clock.t += 5 * DAY_S
    errors: list[BaseException] = []
    made: list[str] = []

    def service() -> None:
        try:
            for _ in range(40):
                made.append(_finished_job(store, "a", n=2, check=False))  # the sweeper may take it at once
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
    worker = threading.Thread(target=service)
    worker.start()
    deleted = 0
    while worker.is_alive():
        deleted += sweeper.sweep_once().jobs_deleted.get("a", 0)
    worker.join(timeout=30)
    deleted += sweeper.sweep_once().jobs_deleted.get("a", 0)
    assert errors == []
    assert deleted == 40 + 3 and all(store.state(j) is None for j in made)
    assert store.state(jobs["a-running"]) == JOB_CANCELLED and store.state(jobs["a-queued"]) is None
    assert verify(audit.path).ok


class FailingOnce(JobStore):
    """A real store whose first look for expired jobs fails (a disk error, say)."""

    failed = False

    def finished_before(self, before_ts: float):
        if not self.failed:
            self.failed = True
            raise sqlite3.OperationalError("disk I/O error")
        return super().finished_before(before_ts)


def test_run_sweeps_periodically_and_goes_on_after_a_failure(world, caplog):
    _cfg, store, jobs, _audit, sweeper, clock = world
    sweeper.jobs.close()
    sweeper.jobs = FailingOnce(Path(store.db.execute("PRAGMA database_list").fetchone()[2]))
    clock.t += 5 * DAY_S

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(sweeper.run(stop))
        async with asyncio.timeout(20):
            while await asyncio.to_thread(store.state, jobs["a"]) is not None:
                await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 5)
    with caplog.at_level(logging.ERROR, logger="kvrelay.router.governance.retention"):
        asyncio.run(go())
    assert sweeper.jobs.failed and "retention sweep failed" in caplog.text and "disk I/O error" in caplog.text
    assert store.state(jobs["b"]) == JOB_DONE


# -- DeleteJob -------------------------------------------------------------------

@dataclass
class _Caller:
    tenant: str


class _Auth:
    """The caller's tenant is its ``tenant`` metadata."""

    async def caller(self, context) -> _Caller:
        return _Caller(dict(context.invocation_metadata()).get("tenant", ""))


class _Core(JobGates):
    """The router core as the job runner sees it; every request runs until cancelled."""

    waiting_interactive = 0
    can_decode = True  # a decode worker is up

    def __init__(self) -> None:
        super().__init__()
        self.started: list[str] = []
        self.cancelled: list[str] = []

    def tenant_known(self, tenant: str) -> bool:
        return True  # every owner is a configured tenant

    async def admit(self, req, caller):
        return req

    async def generate(self, req, caller, *message) -> AsyncIterator[ipb.GenerateResponse]:
        self.started.append(req.request_id)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise
        yield ipb.GenerateResponse()


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, audit: AuditLog | None):
    svc = JobService(_Core(), str(tmp_path / "jobs.sqlite"), 2, _Auth(), audit)
    await svc.start()
    try:
        async with jobs_server(svc) as ch:
            yield svc, jgrpc.JobsStub(ch)
    finally:
        await svc.stop()


def _as(tenant: str) -> tuple[tuple[str, str]]:
    return (("tenant", tenant),)


async def _submit(stub, tenant: str, n: int) -> str:
    reqs = [ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[1, 2, 3]), max_tokens=2) for _ in range(n)]
    job = await stub.SubmitJob(jpb.SubmitJobRequest(name="d", requests=reqs), metadata=_as(tenant), timeout=10)
    return job.id


def test_delete_job_stops_a_running_job_and_only_its_owner_may(tmp_path):
    audit = AuditLog(tmp_path / "audit.jsonl", fsync=False)

    async def go():
        async with serving(tmp_path, audit) as (svc, stub):
            svc._first_invalid = lambda requests, start, owner: None  # no tokenizer here: every request is valid
            job = await _submit(stub, "a", 3)
            async with asyncio.timeout(10):
                while len(svc.core.started) < 2:  # two of its three requests in flight (concurrency 2)
                    await asyncio.sleep(0.01)
            for who, jid in (("b", job), ("a", "no-such-job")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.DeleteJob(jpb.DeleteJobRequest(id=jid), metadata=_as(who), timeout=10)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details() == f"no job {jid!r}"
            assert await svc._db(svc.store.state, job) == JOB_RUNNING  # another tenant's call did nothing
            resp = await stub.DeleteJob(jpb.DeleteJobRequest(id=job), metadata=_as("a"), timeout=20)
            assert (resp.id, resp.requests_deleted) == (job, 3)
            assert sorted(svc.core.cancelled) == sorted(svc.core.started)  # its requests in flight stopped
            assert not svc.inflight and await svc._db(svc.store.get, job) is None
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetJob(jpb.GetJobRequest(id=job), metadata=_as("a"), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            return job
    job = asyncio.run(go())
    records = list(query(audit.path, kind="job"))
    assert [(r["action"], r["job"], r["tenant"]) for r in records] == [("submitted", job, "a"), ("deleted", job, "a")]
    assert records[0]["requests"] == 3 and records[1]["requests_deleted"] == 3
    assert verify(audit.path).ok
    audit.close()


def test_a_deletion_that_cannot_be_audited_is_not_done(tmp_path):
    audit = AuditLog(tmp_path / "audit.jsonl", fsync=False)

    async def go():
        async with serving(tmp_path, audit) as (svc, stub):
            svc._first_invalid = lambda requests, start, owner: None
            job = await _submit(stub, "a", 1)
            await svc._db(svc.store.cancel, job)
            audit.close()  # the log cannot be written now
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.DeleteJob(jpb.DeleteJobRequest(id=job), metadata=_as("a"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == f"job {job!r} is not deleted: its deletion cannot be audited"
            return await svc._db(svc.store.state, job)
    assert asyncio.run(go()) == JOB_CANCELLED


def test_delete_job_without_an_audit_log_deletes_a_finished_job(tmp_path):
    async def go():
        async with serving(tmp_path, None) as (svc, stub):
            svc._first_invalid = lambda requests, start, owner: None
            svc._runner.cancel()  # nothing runs: the job is finished by hand
            job = await _submit(stub, "", 2)
            store = svc.store
            await svc._db(lambda: [store.claim(2), store.finish(job, 0, b"r", True), store.finish(job, 1, b"r", True)])
            assert await svc._db(store.state, job) == JOB_DONE
            resp = await stub.DeleteJob(jpb.DeleteJobRequest(id=job), timeout=10)
            return resp.requests_deleted, await svc._db(store.get, job)
    assert asyncio.run(go()) == (2, None)
