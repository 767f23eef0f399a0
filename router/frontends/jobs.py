"""Batch jobs at the router (``kvrelay.v1.Jobs``): submission, status,
cancellation, results and deletion, over the durable store in jobs_store.py, and the
runner that feeds the jobs' requests through the same path as interactive
ones, at lower priority: it starts a job request only while no interactive
request is waiting for room, and keeps at most ``router.admission.job_concurrency`` in
flight, so jobs fill idle capacity.

With several routers the store is shared (router/core/shared_jobs.py): a router runs
the requests of the tenants whose prompts may enter at its site (RouterCore.door: the
tenant's jurisdictions) and never takes another's, so a job runs only in its tenant's
jurisdictions; every call of a tenant barred here is refused unread
(FAILED_PRECONDITION naming the routers to use), so its jobs are submitted, read and
followed only there; every RECLAIM_S a router takes back the requests held by routers whose etcd
lease ended, so a router's death costs its requests in flight and about a lease
period. A request whose result or release cannot be written while the database is
away stays running here: it runs again when this router restarts or leaves."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from kvrelay.router.core.disk import Work
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.job_limits import job_limit_error
from kvrelay.router.core.jobs_store import (
    JOB_CANCELLED,
    JOB_DONE,
    RESULT_PAGE,
    JobRow,
    JobStorage,
    JobStore,
    JobStoreUnavailable,
    StoredLimits,
    StoreLimitExceeded,
)
from kvrelay.router.core.pipeline import RouterCore
from kvrelay.router.core.quotas import QuotaExceeded
from kvrelay.router.core.records import Auditor, RecordKind
from kvrelay.router.core.requests import Caller, Priority
from kvrelay.router.frontends.grpc_api import STATUS, abort
from kvrelay.router.frontends.job_checks import FairChecker
from kvrelay.router.frontends.peer import GrpcCaller, authorization
from kvrelay.router.governance.audit import AuditError
from kvrelay.runtime.rpc import CallBounds, add_service
from kvrelay.runtime.tenants import TenantSection
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often the runner looks for work and followers look for results."""


DELETE_WAIT_S = 10.0
"""How long DeleteJob waits for a running job's requests in flight to stop."""


RECLAIM_S = 2.0
"""How often a router with others takes back the requests of routers that left (their etcd lease ended)."""


TRANSIENT = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.OVERLOADED})
"""No worker could take the request now (none registered yet, all full): not its fault; it runs again later."""
BACKOFF_S = 1.0
STORE_RETRY_S = 30.0
"""How long a result waits for a jobs database that went away before it is given up (to run again)."""


def _job_proto(row: JobRow) -> jpb.Job:
    return jpb.Job(id=row.id, name=row.name, total=row.total, completed=row.completed, failed=row.failed,
                   created_unix=row.created, finished_unix=row.finished,
                   state=row.state)  # type: ignore[arg-type]  # protobuf takes the int; protoc's .pyi: JobState


def add_jobs_to_server(jobs: JobService, server: grpc.aio.Server, bounds: CallBounds | None = None) -> None:
    """Registers ``jobs`` as ``kvrelay.v1.Jobs`` (``bounds``: on every call); a request message that
    does not parse (a string that is not UTF-8) gets INVALID_ARGUMENT, not UNKNOWN."""
    add_service(server, jobs, jpb.DESCRIPTOR.services_by_name["Jobs"], bounds)


def _store_errors(method):
    """An RPC whose store cannot be reached now ends UNAVAILABLE naming it (not UNKNOWN)."""
    if asyncio.iscoroutinefunction(method):
        @functools.wraps(method)
        async def unary(self, request, context):
            try:
                return await method(self, request, context)
            except JobStoreUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return unary

    @functools.wraps(method)
    async def stream(self, request, context):
        try:
            async for msg in method(self, request, context):
                yield msg
        except JobStoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    return stream


class JobService(jgrpc.JobsServicer):
    def __init__(self, core: RouterCore, db_path: str | Callable[[], JobStorage], concurrency: int,
                 auth: GrpcCaller, audit: Auditor | None = None,
                 live: Callable[[], frozenset[str] | None] | None = None, grace_s: float = 6.0) -> None:
        """``core``: the router core whose request path runs the jobs; ``db_path``: this router's
        SQLite file, or what opens the routers' shared store (router/core/shared_jobs.py); ``auth``
        names each caller's tenant; ``audit``: where job submissions and deletions are recorded
        (None: nowhere); ``live``: with a shared store, the routers live now (None while that is not
        known): requests the others hold are taken back ``grace_s`` after their router left."""
        self.core = core
        self.audit = audit
        self.auth = auth
        self.concurrency = concurrency
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jobs-db")
        self._checker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jobs-check")
        """Validates submitted jobs (tokenizing every prompt), apart from the interactive tokenizer threads."""
        self._checks = FairChecker(lambda reqs, start, owner: self._first_invalid(reqs, start, owner), self._checker)
        """Tenants' submissions take turns on the checker thread, chunk by chunk."""
        self.store: JobStorage | None = None
        self.db_path = db_path
        self.live, self.grace_s = live, grace_s
        self.inflight: set[asyncio.Task] = set()
        self._runner: asyncio.Task | None = None
        self._reclaimer: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._paused_until = 0.0
        self._owner_paused: dict[str, float] = {}
        """Owner -> until when its jobs wait (it was over a quota)."""
        self._barred = core.barred_here()
        """Tenants whose job requests this router never takes (their jurisdictions exclude its site)."""

    @property
    def _store(self) -> JobStorage:
        """The store, which :meth:`start` opens."""
        if self.store is None:
            raise RuntimeError("the job service is not started: it has no store")
        return self.store

    async def _db(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def start(self) -> None:
        opener = self.db_path if callable(self.db_path) else functools.partial(JobStore, self.db_path)
        self.store = await self._db(opener)
        resumed = await self._db(self.store.resume)
        if resumed:
            log.info("resuming %d job requests left running by the previous router", resumed)
        self._runner = asyncio.create_task(self._run())
        if self.live is not None:
            self._reclaimer = asyncio.create_task(self._reclaim())

    async def stop(self) -> None:
        for task in (self._runner, self._reclaimer):
            if task is not None:
                task.cancel()
        for t in list(self.inflight):
            t.cancel()
        await asyncio.gather(*self.inflight, return_exceptions=True)
        await self._checks.aclose()
        if self.store is not None:
            await self._db(self.store.close)
        self._pool.shutdown(wait=True)
        self._checker.shutdown(wait=False, cancel_futures=True)

    # -- API -------------------------------------------------------------------
    async def _owner(self, context) -> str:
        """The calling tenant (a job belongs to its submitter), if its prompts may enter here: a
        tenant barred at this router (RouterCore.door) submits, reads and deletes nothing here."""
        try:
            owner = (await self.auth.caller(context)).tenant
        except RouterError as exc:
            self.core.audit_refused("jobs", exc, "token" if authorization(context) else "none")
            await abort(context, exc)
        try:
            self.core.door(owner, "jobs")
        except RouterError as exc:
            await abort(context, exc)
        return owner

    @_store_errors
    async def SubmitJob(self, request: jpb.SubmitJobRequest, context) -> jpb.Job:
        """Validates every request as the interactive path would, then stores the job (all or
        nothing). Refused (RESOURCE_EXHAUSTED) before any prompt is tokenized: a router short
        of disk (router.records.min_free_bytes_for_jobs), a tenant over its requests_per_minute
        quota (a submission counts as one request; its requests count again as they run) or
        whose stored jobs would go past its max_stored_jobs or max_stored_job_bytes."""
        owner = await self._owner(context)
        if not request.requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a job needs at least one request")
        problem = job_limit_error(request.name, request.requests)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        policy = self.core.tenants.of(owner)
        limits = StoredLimits(policy.max_stored_jobs, policy.max_stored_job_bytes)
        try:
            await self._admissible(owner, request, policy, limits)
            # on the checker thread, tenants in turn: a 100,000-request job holds up no interactive request,
            # and one tenant's jobs hold up another's submission by at most a chunk
            problem = await self._checks.check_job(owner, request.requests)
        except RouterError as exc:
            log.info("job submission of tenant %s refused: %s", owner, exc.message)
            await abort(context, exc)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            row = await self._db(self._store.submit, request.name,
                                 [r.SerializeToString() for r in request.requests], owner, limits)
        except StoreLimitExceeded as exc:  # another submission of the tenant's was stored meanwhile
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        log.info("job %s (%s): %d requests", row.id, request.name or "unnamed", row.total)
        self._audit({"action": "submitted", "job": row.id, "tenant": owner, "requests": row.total})
        self._wake.set()
        return _job_proto(row)

    async def _admissible(self, owner: str, request: jpb.SubmitJobRequest, policy: TenantSection,
                          limits: StoredLimits) -> None:
        """Raises RouterError OVERLOADED when the job may not be taken now: the router's disk,
        the tenant's stored jobs, its request quota (charged one submission, last, so a
        submission refused for another reason costs the tenant nothing)."""
        disk = self.core.disk.refusal(Work.JOBS)
        if disk is not None:
            raise disk
        size = sum(r.ByteSize() for r in request.requests)
        over = await self._db(self._store.over_limits, owner, size, limits)
        if over is not None:
            raise RouterError(ErrorKind.OVERLOADED, over)
        quota = self.core.quotas.take_submission(policy)
        if quota is not None:
            raise quota

    def _first_invalid(self, requests: Sequence[ipb.GenerateRequest], start: int, owner: str) -> str | None:
        """``requests[i]: why`` for the first request the router would refuse (None: none);
        ``requests`` are the job's from index ``start`` on."""
        caller = Caller(owner)
        for i, r in enumerate(requests, start):
            if r.sampling.logprobs or r.sampling.top_logprobs:
                return f"requests[{i}]: logprobs are not kept in job results; submit without them"
            if r.resume_token_ids or r.resume_ticket:
                return f"requests[{i}]: resume_token_ids and resume_ticket resume a stream; a job's request has none"
            try:
                self.core.prepare(r, caller)
            except RouterError as exc:
                return f"requests[{i}]: {exc.message}"
        return None

    async def _row(self, job_id: str, context) -> JobRow:
        """The caller's job (another tenant's is as unknown as a missing one)."""
        owner = await self._owner(context)
        row = await self._db(self._store.get, job_id)
        if row is None or row.owner != owner:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        return row

    @_store_errors
    async def GetJob(self, request: jpb.GetJobRequest, context) -> jpb.Job:
        return _job_proto(await self._row(request.id, context))

    @_store_errors
    async def ListJobs(self, request, context) -> jpb.ListJobsResponse:
        owner = await self._owner(context)
        return jpb.ListJobsResponse(jobs=[_job_proto(r) for r in await self._db(self._store.list, owner)])

    @_store_errors
    async def CancelJob(self, request: jpb.CancelJobRequest, context) -> jpb.Job:
        row = await self._row(request.id, context)
        self._audit({"action": "cancelled", "job": row.id, "tenant": row.owner})
        return _job_proto(await self._db(self._store.cancel, request.id))

    def _audit(self, fields: dict) -> None:
        """A job record in the audit log (submission, cancellation), written off the event loop."""
        if self.audit is not None:
            self.audit.append(RecordKind.JOB, fields)

    @_store_errors
    async def DeleteJob(self, request: jpb.DeleteJobRequest, context) -> jpb.DeleteJobResponse:
        """Deletes the caller's job with its requests and results (another
        tenant's is NOT_FOUND). A job that runs is cancelled first and its
        requests in flight stopped (UNAVAILABLE if they have not within
        DELETE_WAIT_S). The deletion is written to the audit log before it
        is done (UNAVAILABLE, nothing deleted, if it cannot be)."""
        row = await self._row(request.id, context)
        if row.state not in (JOB_DONE, JOB_CANCELLED) or self._tasks_of(row.id):
            await self._db(self._store.cancel, row.id)
            if not await self._stop_requests(row.id):
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"job {row.id!r} is cancelled but its requests "
                                    f"did not stop within {DELETE_WAIT_S:.0f} s; delete it again shortly")
        if self.audit is not None:
            try:
                await asyncio.to_thread(self.audit.append_durable, RecordKind.JOB, {
                    "action": "deleted", "job": row.id, "tenant": row.owner, "requests_deleted": row.total})
            except AuditError as exc:
                log.error("job %s not deleted: %s", row.id, exc)
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"job {row.id!r} is not deleted: its deletion cannot be audited")
        n = await self._db(self._store.delete, row.id)
        if n is None:  # deleted meanwhile (the retention sweeper)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {row.id!r}")
        log.info("job %s deleted by its owner with its %d requests", row.id, n)
        return jpb.DeleteJobResponse(id=row.id, requests_deleted=n)

    def _tasks_of(self, job: str) -> list[asyncio.Task]:
        """The job's requests in flight (their tasks are named ``job <id>/<index>``)."""
        return [t for t in self.inflight if t.get_name().startswith(f"job {job}/")]

    async def _stop_requests(self, job: str) -> bool:
        """Cancels the job's requests in flight; True once they have stopped (within DELETE_WAIT_S)."""
        tasks = self._tasks_of(job)
        for t in tasks:
            t.cancel()
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=DELETE_WAIT_S)
        return not pending

    @_store_errors
    async def JobResults(self, request: jpb.JobResultsRequest, context) -> AsyncIterator[jpb.JobResult]:
        """The results stored so far in index order; with ``follow``, then each
        new one as it is stored. Every poll reads only the results stored since
        the previous one (by their ``seq``), so following a 100,000-request job
        costs what its new results cost, never a re-read of the stored ones."""
        await self._row(request.id, context)
        seen = await self._db(self._store.last_seq, request.id)
        async for result in self._stored(request.id, request.from_index, seen):
            yield result
        while request.follow:
            # the job's state first: a finished job's results were stored with or before its state
            state = await self._db(self._store.state, request.id)
            more = True
            while more:
                seen, results, more = await self._stored_after(request.id, request.from_index, seen)
                for result in results:
                    yield result
            if state in (None, JOB_DONE, JOB_CANCELLED):
                return
            await asyncio.sleep(POLL_S)

    async def _stored(self, job: str, from_index: int, upto_seq: int) -> AsyncIterator[jpb.JobResult]:
        """Results with index >= ``from_index`` stored no later than ``upto_seq``, in index order, page by page."""
        after = -1
        while True:
            page = await self._db(self._store.results, job, from_index, after, upto_seq)
            for _, _, blob in page:
                yield jpb.JobResult.FromString(blob)
            if len(page) < RESULT_PAGE:
                return
            after = page[-1][1]

    async def _stored_after(self, job: str, from_index: int, seen: int) -> tuple[int, list[jpb.JobResult], bool]:
        """One page of the results stored after ``seen`` (those with index >=
        ``from_index``, in the order stored): the last seq read, the results,
        and whether there may be more."""
        page = await self._db(self._store.results_after, job, seen)
        results = [jpb.JobResult.FromString(blob) for _, idx, blob in page if idx >= from_index]
        return (page[-1][0] if page else seen), results, len(page) == RESULT_PAGE

    # -- runner ----------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except TimeoutError:
                pass
            self._wake.clear()
            if self.core.waiting_interactive > 0:
                continue  # interactive requests first
            if loop.time() < self._paused_until or not self.core.can_decode:
                continue  # nothing can serve now (e.g. a router that just restarted)
            room = self.concurrency - len(self.inflight)
            now = loop.time()
            skipped = self._barred | frozenset(o for o, until in self._owner_paused.items() if until > now)
            try:
                claimed = await self._db(self._store.claim, room, skipped)
            except JobStoreUnavailable as exc:
                log.warning("jobs wait: %s", exc)
                self._paused_until = loop.time() + BACKOFF_S
                continue
            for job, idx, blob, owner in claimed:
                task = asyncio.create_task(self._one(job, idx, ipb.GenerateRequest.FromString(blob), owner),
                                           name=f"job {job}/{idx}")
                self.inflight.add(task)
                task.add_done_callback(self.inflight.discard)

    async def _reclaim(self) -> None:
        """Every RECLAIM_S, the requests of routers no longer live go back to pending (while the
        live routers are known: not while etcd is away)."""
        assert self.live is not None  # started only with it
        while True:
            await asyncio.sleep(RECLAIM_S)
            live = self.live()
            if live is None:
                continue
            try:
                n = await self._db(self._store.reclaim, live, self.grace_s)
            except JobStoreUnavailable as exc:
                log.warning("could not take back the requests of routers that left: %s", exc)
                continue
            if n:
                log.warning("took back %d job requests of routers that left; they run again", n)
                self._wake.set()

    async def _one(self, job: str, idx: int, req: ipb.GenerateRequest, owner: str) -> None:
        if not req.request_id:
            req.request_id = f"{job}-{idx}"
        result = jpb.JobResult(index=idx, request_id=req.request_id)
        ok = True
        caller = Caller(owner, priority=Priority.BATCH, api="jobs", credential="job")  # as its owner, no deadline
        try:
            if not self.core.tenant_known(owner):  # removed from the config since: no policy, no service
                raise RouterError(ErrorKind.PERMISSION_DENIED, f"the job's owner {owner!r} is not a configured "
                                                               "tenant (any more); its requests do not run")
            async for msg in self.core.generate(await self.core.admit(req, caller), caller, req):
                result.token_ids.extend(msg.token_ids)
                result.text += msg.text
                if msg.HasField("finish"):
                    result.finish.CopyFrom(msg.finish)
        except QuotaExceeded as exc:  # its owner's quota: that owner's jobs wait, nobody else's
            await self._release(job, idx)
            self._owner_paused[owner] = asyncio.get_running_loop().time() + (exc.retry_after_s or BACKOFF_S)
            return
        except RouterError as exc:
            if exc.kind in TRANSIENT:
                await self._release(job, idx)
                self._paused_until = asyncio.get_running_loop().time() + BACKOFF_S
                log.info("job %s request %d: %s; it runs again later", job, idx, exc)
                return
            ok, result.error = False, f"{STATUS[exc.kind].name}: {exc.message}"
        except asyncio.CancelledError:
            await asyncio.shield(self._release(job, idx))  # runs again after a restart
            raise
        except Exception as exc:  # a bug must not leave the request running forever: record it
            log.exception("job %s request %d failed inside the router", job, idx)
            ok, result.error = False, f"internal error: {exc}"
        await self._store_result(job, idx, result.SerializeToString(), ok)
        self._wake.set()

    async def _release(self, job: str, idx: int) -> None:
        """The request back to pending; with the store away it stays running here (module docstring)."""
        try:
            await self._db(self._store.release, job, idx)
        except JobStoreUnavailable as exc:
            log.warning("job %s request %d stays running here until this router restarts or leaves: %s",
                        job, idx, exc)

    async def _store_result(self, job: str, idx: int, blob: bytes, ok: bool) -> None:
        """Stores a result, trying again for STORE_RETRY_S while the store is away; after that the
        request stays running here and runs again when this router restarts or leaves."""
        end = asyncio.get_running_loop().time() + STORE_RETRY_S
        while True:
            try:
                if not await self._db(self._store.finish, job, idx, blob, ok):
                    log.warning("job %s request %d no longer runs here; its result is not stored twice", job, idx)
                return
            except JobStoreUnavailable as exc:
                if asyncio.get_running_loop().time() > end:
                    log.error("job %s request %d: result not stored (%s); it runs again later", job, idx, exc)
                    return
                await asyncio.sleep(BACKOFF_S)
