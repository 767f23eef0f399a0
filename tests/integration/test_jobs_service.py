"""The Jobs API over a real gRPC server and SQLite store, with a stand-in for
the router core (no model): a job over a limit, or with a bad request, is
refused with INVALID_ARGUMENT naming the limit or the request; following a
job's results reads each stored result once, however many polls it takes,
also when results finish out of index order."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

import kvrelay.router.core.job_limits as limits
import kvrelay.router.frontends.jobs as jobs_mod
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.jobs_store import DONE, JobStore
from kvrelay.router.frontends.jobs import JobService
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc
from tests.integration.helpers import JobGates, jobs_server

VOCAB = 1000


@dataclass
class _Caller:
    tenant: str = ""


class _Auth:
    """Every caller is the tenant ""."""

    async def caller(self, context) -> _Caller:
        return _Caller()


class _Core(JobGates):
    """What SubmitJob needs of the router core: its gates, prepare (two of its rules) and the tokenizer threads."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenizers = concurrent.futures.ThreadPoolExecutor(1)

    def prepare(self, req: ipb.GenerateRequest, caller) -> None:
        if req.HasField("max_tokens") and req.max_tokens < 1:
            raise RouterError(ErrorKind.INVALID, f"max_tokens must be >= 1, got {req.max_tokens}")
        if any(not 0 <= t < VOCAB for t in req.token_ids.ids):
            raise RouterError(ErrorKind.INVALID, f"token ids must be in [0, {VOCAB})")


class CountingStore(JobStore):
    """A JobStore that counts the result rows it reads and the full job reads (``get``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.rows_read = 0
        self.gets = 0
        self.polls = 0

    def get(self, job: str):
        self.gets += 1
        return super().get(job)

    def state(self, job: str):
        self.polls += 1
        return super().state(job)

    def results(self, *args, **kw):
        rows = super().results(*args, **kw)
        self.rows_read += len(rows)
        return rows

    def results_after(self, *args, **kw):
        rows = super().results_after(*args, **kw)
        self.rows_read += len(rows)
        return rows


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[tuple[JobService, jgrpc.JobsStub]]:
    """A Jobs server on a free loopback port (its runner not started) and a stub for it."""
    svc = JobService(_Core(), ":memory:", 1, _Auth())
    svc.store = CountingStore(":memory:")
    try:
        async with jobs_server(svc) as ch:
            svc.channel = ch
            yield svc, jgrpc.JobsStub(ch)
    finally:
        svc._pool.shutdown(wait=True)
        svc.core.tokenizers.shutdown(wait=True)


def _submit_error(requests: list[ipb.GenerateRequest], name: str = "") -> tuple[grpc.StatusCode, str]:
    async def go():
        async with serving() as (svc, stub):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitJob(jpb.SubmitJobRequest(name=name, requests=requests), timeout=30)
            assert svc.store.list() == []  # nothing stored
            return err.value.code(), err.value.details()
    return asyncio.run(go())


def _req(**kw) -> ipb.GenerateRequest:
    return ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[1, 2, 3]), **kw)


def test_a_job_over_the_request_limit_is_refused_naming_it():
    code, details = _submit_error([_req()] * (limits.MAX_JOB_REQUESTS + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "job has 100001 requests; at most 100000"


def test_a_request_over_the_byte_limit_is_refused_naming_its_index():
    big = ipb.GenerateRequest(prompt="x" * (limits.MAX_REQUEST_BYTES + 10))
    code, details = _submit_error([_req(), big])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("requests[1]: ") and f"at most {limits.MAX_REQUEST_BYTES} (1 MiB)" in details


def test_a_job_over_the_byte_limit_is_refused(monkeypatch):
    monkeypatch.setattr(limits, "MAX_JOB_BYTES", 1000)
    code, details = _submit_error([ipb.GenerateRequest(prompt="y" * 100)] * 20)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("job is ") and "bytes; at most 1000" in details


def test_a_long_name_and_a_bad_request_are_refused_naming_them():
    code, details = _submit_error([_req()], name="n" * 300)
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "job name has 300 characters; at most 256")
    code, details = _submit_error([_req(), _req(max_tokens=3), _req(max_tokens=0)])
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "requests[2]: max_tokens must be >= 1, got 0")
    code, details = _submit_error([_req(), ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, VOCAB]))])
    assert details == f"requests[1]: token ids must be in [0, {VOCAB})"
    # job results carry no logprobs: asking for them is refused, not ignored
    code, details = _submit_error([_req(), _req(sampling=ipb.SamplingParams(logprobs=True, top_logprobs=2))])
    assert details == "requests[1]: logprobs are not kept in job results; submit without them"


def test_a_job_that_is_not_utf8_is_invalid_argument_not_unknown():
    inner = b"\x12\x01\xff"  # GenerateRequest{prompt: the byte 0xff}
    raw = b"\x12" + bytes([len(inner)]) + inner  # SubmitJobRequest{requests: [that]}

    async def go():
        async with serving() as (svc, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await svc.channel.unary_unary("/kvrelay.v1.Jobs/SubmitJob")(raw, timeout=10)
            return err.value
    err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.details()


def _finish(store: JobStore, job: str, order: list[int]) -> None:
    for i in order:
        assert store.finish(job, i, jpb.JobResult(index=i, text=f"r{i}").SerializeToString(), True)


async def _follow(stub: jgrpc.JobsStub, job: str, from_index: int = 0) -> list[int]:
    call = stub.JobResults(jpb.JobResultsRequest(id=job, follow=True, from_index=from_index), timeout=60)
    return [r.index async for r in call]


async def _until(cond, timeout_s: float = 10.0) -> None:
    """Waits (at most ``timeout_s``) until ``cond()``."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


def test_following_reads_each_result_once_whatever_the_order(monkeypatch):
    """3,000 requests, 1,200 stored before the follower starts, the rest
    stored in 6 rounds while it polls, each round in reverse index order (a
    reader going by "index > the last index seen" would miss most of them)."""
    monkeypatch.setattr(jobs_mod, "POLL_S", 0.02)
    n, first = 3000, 1200

    async def go():
        async with serving() as (svc, stub):
            job = (await svc._db(svc.store.submit, "follow", [b"r"] * n)).id
            await svc._db(svc.store.claim, n)
            await svc._db(_finish, svc.store, job, list(range(first))[::-1])
            svc.store.gets = 0
            follower = asyncio.create_task(_follow(stub, job))
            for k in range(6):
                polls = svc.store.polls
                await _until(lambda: svc.store.polls >= polls + 2)  # a poll or two finds nothing new  # noqa: B023 (called before the loop moves on)
                lo = first + k * (n - first) // 6
                await svc._db(_finish, svc.store, job, list(range(lo, lo + (n - first) // 6))[::-1])
            got = await asyncio.wait_for(follower, 30)
            return got, svc.store
    got, store = asyncio.run(go())
    assert sorted(got) == list(range(n))  # every result, once
    assert got[:first] == list(range(first))  # those stored before: in index order
    assert store.polls >= 12  # it polled many times...
    assert store.rows_read == n  # ...and read each stored result once, never again
    assert store.gets == 1  # the job's counts (a scan of its rows) once, not per poll


def test_following_from_an_index_skips_the_rest_without_reading_them_again(monkeypatch):
    monkeypatch.setattr(jobs_mod, "POLL_S", 0.02)

    async def go():
        async with serving() as (svc, stub):
            job = (await svc._db(svc.store.submit, "from", [b"r"] * 100)).id
            await svc._db(svc.store.claim, 100)
            follower = asyncio.create_task(_follow(stub, job, from_index=60))
            await _until(lambda: svc.store.polls > 0)  # it follows: every result comes from a poll
            await svc._db(_finish, svc.store, job, list(range(100))[::-1])
            return await asyncio.wait_for(follower, 30), svc.store
    got, store = asyncio.run(go())
    assert sorted(got) == list(range(60, 100))
    assert store.rows_read == 100  # those under 60 too, but each once (the poll moves past them)


def _vm_steps(store: JobStore, fn) -> int:
    """SQLite virtual-machine steps ``fn`` takes: the work its queries do."""
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0
    store.db.set_progress_handler(tick, 1)
    try:
        fn()
    finally:
        store.db.set_progress_handler(None, 1)
    return steps[0]


def test_a_poll_costs_the_new_results_not_the_stored_ones():
    costs = []
    for n in (50, 5000):
        store = JobStore(":memory:")
        job = store.submit("cost", [b"r"] * n).id
        store.claim(n)
        _finish(store, job, range(n - 3))
        seen = store.last_seq(job)
        _finish(store, job, range(n - 3, n))
        costs.append(_vm_steps(store, lambda: (store.state(job), store.results_after(job, seen))))  # noqa: B023 (called before the loop moves on)
        assert [idx for _, idx, _ in store.results_after(job, seen)] == [n - 3, n - 2, n - 1]
        store.close()
    assert costs[1] == costs[0]  # 100x the stored results, the same work


OLD_SCHEMA = """
CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, state INTEGER NOT NULL,
    total INTEGER NOT NULL, created REAL NOT NULL, finished REAL NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT '');
CREATE TABLE items (job TEXT NOT NULL, idx INTEGER NOT NULL, request BLOB NOT NULL,
    status INTEGER NOT NULL, result BLOB, PRIMARY KEY (job, idx));
"""


def test_results_stored_before_the_seq_column_stay_readable(tmp_path):
    db = tmp_path / "jobs.sqlite"
    old = sqlite3.connect(db)
    old.executescript(OLD_SCHEMA)
    old.execute("INSERT INTO jobs VALUES ('j', 'old', 2, 4, 0, 0, '')")
    old.executemany("INSERT INTO items VALUES ('j', ?, x'', ?, ?)",
                    [(0, DONE, b"a"), (1, 1, None), (2, DONE, b"c"), (3, 1, None)])
    old.commit()
    old.close()
    store = JobStore(db)
    assert [(idx, blob) for _, idx, blob in store.results("j")] == [(0, b"a"), (2, b"c")]
    seen = store.last_seq("j")
    assert store.finish("j", 3, b"d", True) and store.finish("j", 1, b"b", True)
    assert [(idx, blob) for _, idx, blob in store.results_after("j", seen)] == [(3, b"d"), (1, b"b")]
    assert store.state("j") == 3  # done
    store.close()
