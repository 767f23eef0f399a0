"""The router's core, which knows no front end: one entry,
:meth:`RouterCore.generate`, takes a validated :class:`~kvrelay.router.core.requests.Request`
and its :class:`~kvrelay.router.core.requests.Caller` and yields the messages of its
answer (``kvrelay.v1.GenerateResponse``: tokens, and a last one with the
finish reason, usage and placement). Every failure is a
:class:`~kvrelay.router.core.errors.RouterError`; the gRPC API, the HTTP API and batch
jobs are thin adapters over this.

Per request: ask the prefix index what each worker caches of the prompt ->
the placement policy picks a decode worker D and a prefill worker P, or
colocated at D (router/placement/place.py) -> one attempt on it (router/core/relay.py).
When nothing can take it yet (every eligible worker full, or none
registered), it waits, holding nothing, within its deadline and the
configured waits. When a worker fails it, recovery (router/core/recovery.py)
places it again or migrates the stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvrelay.engine.hashing import hash_blocks
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.router.cluster.membership import Membership, SoloMembership
from kvrelay.router.cluster.pools import PoolManager
from kvrelay.router.cluster.registry import WorkerRegistry
from kvrelay.router.cluster.usage import UsageLedger
from kvrelay.router.core.admission import FairQueue
from kvrelay.router.core.auth import TenantSalts
from kvrelay.router.core.disk import DiskReserve, Work
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.observe import RequestObservation, RouterTelemetry, prometheus_targets
from kvrelay.router.core.quotas import Quotas, TokenBucket
from kvrelay.router.core.records import Auditor, RecordKind
from kvrelay.router.core.recovery import Failover, Recovery
from kvrelay.router.core.relay import Relay, RelayContext, placement_proto
from kvrelay.router.core.request_record import RequestRecord, prompt_text
from kvrelay.router.core.requests import (
    MAX_JURISDICTIONS,
    Caller,
    ModelLimits,
    Priority,
    Request,
    parse_request,
)
from kvrelay.router.core.resume import ResumeTickets
from kvrelay.router.core.tenancy import TenantPolicies
from kvrelay.router.placement.errors import PlacementError, PlacementFailure, Wait
from kvrelay.router.placement.place import Placement, PlacementRequest, Policy, place
from kvrelay.runtime.config import AdmissionSection, ClusterConfig
from kvrelay.runtime.roles import Role
from kvrelay.runtime.topology import Topology
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

ADMISSION_BACKOFF_S = (0.05, 1.0)
"""First and longest pause of a request waiting at the router for a decode worker with room, or for one to come back."""

REFUSALS_PER_S = 20.0
"""Audit records of calls refused for their credentials, at most (the rest are counted)."""


class RateLimit:
    """At most ``per_s`` events a second (a burst of five seconds' worth); counts the ones it drops."""

    def __init__(self, per_s: float) -> None:
        self.bucket = TokenBucket(per_s * 5, per_s, per_s * 5, time.monotonic())
        self.dropped = 0

    def allow(self) -> int | None:
        """None: drop this one; else the number dropped since the last one allowed."""
        if self.bucket.wait_s(1, time.monotonic()) > 0:
            self.dropped += 1
            return None
        self.bucket.take(1)
        dropped, self.dropped = self.dropped, 0
        return dropped


SHED_RETRY_MAX_S = 30.0
"""Longest retry hint given to a request shed early. The queue's rate, measured at a backlog's
start, can make its turn look several times further off than it is: with a 300 s cap, requests
told to come back in ~300 s returned to an idle cluster (benchmarks/RESULTS.md, issue 36). A
refusal costs the cluster nothing, so a client asked back sooner is at worst refused again."""
PLACEMENT_KIND = {PlacementFailure.CONSTRAINT: ErrorKind.CONSTRAINT, PlacementFailure.CAPACITY: ErrorKind.OVERLOADED,
                  PlacementFailure.UNAVAILABLE: ErrorKind.UNAVAILABLE}


class AdmissionWait:
    """How long one request may still wait at the router, for room or for workers."""

    def __init__(self, r: AdmissionSection, caller: Caller) -> None:
        self.loop = asyncio.get_running_loop()
        remaining = caller.time_remaining()
        now, left = self.loop.time(), float("inf") if remaining is None else remaining
        self.until = {Wait.ROOM: now + min(r.admission_wait_s, left),
                      Wait.WORKERS: now + min(r.unavailable_wait_s, left), Wait.NOTHING: 0.0}
        self.backoff = ADMISSION_BACKOFF_S[0]

    def allows(self, wait: Wait) -> bool:
        """Waiting the next backoff still ends before the wait's limit."""
        return self.loop.time() + self.backoff < self.until[wait]

    async def pause(self) -> None:
        await asyncio.sleep(self.backoff)
        self.backoff = min(ADMISSION_BACKOFF_S[1], self.backoff * 2)


@dataclass(slots=True)
class Flight:
    """One admitted request on its way through the core: what every step of it reads
    (the request, who sent it, its trace and metrics, its attempts so far, how long it
    may still wait), carried as one object instead of threaded through each call."""

    req: Request
    caller: Caller
    obs: RequestObservation
    run: Recovery
    admission: AdmissionWait


def refusal(exc: PlacementError) -> RouterError:
    """What the caller is told when no placement is possible and waiting cannot help."""
    kind = PLACEMENT_KIND[exc.kind]
    if kind is not ErrorKind.OVERLOADED:
        return RouterError(kind, exc.message)
    ms = max(1, int(exc.retry_after_s * 1e3))
    return RouterError(kind, f"{exc.message}; retry in {ms} ms", retry_after_s=ms / 1e3)


@dataclass(slots=True)
class CoreParts:
    """What the core works with, built by the composition root (router/main.py
    ``core_parts``) in the order they depend on each other."""

    salts: TenantSalts
    """Each tenant's prefix-cache salt (router/core/auth.py)."""
    tickets: ResumeTickets
    """Issues and checks the tickets that let a stream resume at another router (router/core/resume.py)."""
    tenants: TenantPolicies
    quotas: Quotas
    queue: FairQueue
    """Requests waiting for room, served by tenant class, priority and weight (router/core/admission.py)."""
    topology: Topology
    usage: UsageLedger
    """Usage accounting from the workers' own counters, which their heartbeats carry (router/cluster/usage.py)."""
    registry: WorkerRegistry
    pools: PoolManager
    policy: Policy
    """The placement policy (router/placement/place.py)."""
    telemetry: RouterTelemetry
    """Traces, metrics and the last minute's latency (router/core/observe.py)."""
    tokenizers: concurrent.futures.ThreadPoolExecutor
    """Where prompts are tokenized, off the event loop (the tokenizer lets go of the GIL)."""
    disk: DiskReserve
    """Free space where the router's records are; new work refused under its reserves (router/core/disk.py)."""
    membership: Membership = field(default_factory=SoloMembership)
    """The deployment's routers and the workers they share (router/cluster/membership.py)."""


class RouterCore:
    """Admission, placement, the P/D relay and recovery for every front end."""

    def __init__(self, cfg: ClusterConfig, tokenizer: Tokenizer, limits: ModelLimits, parts: CoreParts,
                 audit: Auditor | None = None, metrics_address: str = "") -> None:
        """``parts``: built by router/main.py ``core_parts``. ``audit``: the
        audit log's writer (None: nothing is audited). ``metrics_address``:
        where the process serves /metrics ("" when it serves none)."""
        self.cfg = cfg
        self.tok = tokenizer
        self.limits = limits
        self.salts = parts.salts
        self.tickets = parts.tickets
        self.tenants = parts.tenants
        self.quotas = parts.quotas
        self.queue = parts.queue
        self.topology = parts.topology
        self.usage = parts.usage
        self.registry = parts.registry
        self.pools = parts.pools
        self.policy = parts.policy
        self.telemetry = parts.telemetry
        self.tokenizers = parts.tokenizers
        self.disk = parts.disk
        self.membership = parts.membership
        self._refusals = RateLimit(REFUSALS_PER_S)
        self.audit = audit
        """The audit log's writer (router/governance/audit_writer.py); None: no audit log."""
        self.metrics_address = metrics_address
        """Where the router serves /metrics ("" when off)."""
        self._relaying = RelayContext(self.registry, self.topology, self.pools.window, cfg.router.liveness.kv_lease_s,
                                      self.queue.pump)

    @property
    def can_decode(self) -> bool:
        """Some decode worker is healthy and takes work (a batch job waits otherwise)."""
        return bool(self.registry.candidates(Role.DECODE))

    def metrics_targets(self) -> list[dict]:
        """Every process's /metrics as Prometheus ``file_sd`` entries (the router's and its workers')."""
        return prometheus_targets(self.metrics_address, self.cfg.router.site or "",
                                  [w.info for w in self.registry.workers.values()])

    async def aclose(self) -> None:
        """Stops the tokenizer threads and closes the channels to workers and the usage ledger."""
        self.tokenizers.shutdown(wait=False, cancel_futures=True)
        await self.registry.close()
        await self.usage.close()

    def tenant_known(self, tenant: str) -> bool:
        """``tenant`` is configured (a job's owner removed from the config since gets no service)."""
        return self.tenants.known(tenant)

    @property
    def waiting_interactive(self) -> int:
        """Interactive requests waiting at the router for room (batch jobs hold back meanwhile)."""
        return self.queue.interactive_waiting

    def prepare(self, msg: ipb.GenerateRequest, caller: Caller) -> Request:
        """Validates and tokenizes a request under its tenant's policy: its prompts
        hash into the tenant's prefix-cache domain, its jurisdictions are narrowed
        to the tenant's (never widened), its length is held to ``max_context``."""
        req = parse_request(msg, self.tok, self.limits, salt=self.salts.of(caller.tenant),
                            max_prompt_bytes=self.cfg.router.api.max_prompt_bytes)
        req.work.tenant = caller.tenant
        req.work.batch = caller.priority is Priority.BATCH  # engines admit it after waiting interactive ones
        req.allowed_jurisdictions = self.tenants.jurisdictions(caller.tenant, req.allowed_jurisdictions)
        self.tenants.check_context(caller.tenant, len(req.work.prompt_token_ids), req.work.max_tokens)
        req.binding = self.tickets.bind(caller.tenant, self.limits.name, req.work)
        if req.resume:  # prompt it would compute: only after tokens this tenant really received
            self.tickets.check(req.binding, req.resume, msg.resume_ticket, caller.tenant)
        elif msg.resume_ticket:
            raise RouterError(ErrorKind.INVALID, "resume_ticket is given without resume_token_ids: send both to "
                                                 "resume a stream, neither to start one")
        req.block_hashes = hash_blocks(req.work.prompt_token_ids, self.cfg.cache.block_size, req.work.salt)
        return req

    def _block_hashes(self, req: Request, work: wpb.WorkRequest) -> list[int]:
        """The block hashes of an attempt's prompt: the request's own, extended
        over the tokens already sent when a migration re-prefills them."""
        bs, have = self.cfg.cache.block_size, req.block_hashes
        if have is None:
            return hash_blocks(work.prompt_token_ids, bs, work.salt)
        if len(work.prompt_token_ids) // bs <= len(have):
            return have
        return have + hash_blocks(work.prompt_token_ids, bs, work.salt, have[-1] if have else None, len(have))

    async def admit(self, msg: ipb.GenerateRequest, caller: Caller) -> Request:
        """:meth:`prepare` in the tokenizer threads, so a long prompt holds up no one
        else (a prompt over ``router.api.max_prompt_bytes`` is refused there before
        tokenizing). A refused request is audited here; an admitted one by :meth:`generate`."""
        t0 = time.perf_counter()
        try:
            early = self.disk.refusal(Work.REQUESTS)  # no room for its audit record: not served without one
            if early is None:  # rate and concurrency: before tokenizing
                early = self.quotas.refusal(self.tenants.of(caller.tenant), 0)
            if early is not None:
                raise early
            req = await asyncio.get_running_loop().run_in_executor(self.tokenizers, self.prepare, msg, caller)
        except RouterError as exc:
            record = self._record(msg, caller)
            self._audit(record.record(exc))
            self.telemetry.refused(caller, exc)
            raise
        except asyncio.CancelledError as exc:  # the caller left while it was tokenized
            self.telemetry.refused(caller, exc)
            raise
        req.arrived, req.tokenized_s = t0, time.perf_counter() - t0
        req.chat = msg.WhichOneof("input") == "messages"
        return req

    def _record(self, msg: ipb.GenerateRequest, caller: Caller) -> RequestRecord:
        logged = prompt_text(msg) if self.tenants.of(caller.tenant).log_prompts else None
        # what the client sent, bounded as the checks bound it (a refused request may be larger)
        requested = frozenset(j[:32] for j in msg.allowed_jurisdictions[:MAX_JURISDICTIONS]) or None
        return RequestRecord(caller, (msg.model or self.limits.name)[:128], msg.request_id[:128], requested, logged)

    def _audit(self, record: dict, kind: RecordKind = RecordKind.REQUEST) -> None:
        """Queues one record (the writer logs one it cannot write; serving goes on)."""
        if self.audit is not None:
            self.audit.append(kind, record)

    def audit_refused(self, caller_api: str, error: RouterError, credential: str) -> None:
        """A call refused before it had a tenant (missing or wrong credentials), at most
        REFUSALS_PER_S a second in the log (a flood of them is counted, not written one by one)."""
        suppressed = self._refusals.allow()
        if suppressed is not None:
            self._audit({"api": caller_api, "credential": credential, "outcome": error.kind.value,
                         "error": error.message[:300], "suppressed_before": suppressed}, RecordKind.REFUSAL)

    def reads_prompts_of(self, tenant: str, jurisdiction: str) -> bool:
        """A router in ``jurisdiction`` may read ``tenant``'s prompts (its jurisdictions allow it, or it has none)."""
        allowed = self.tenants.of(tenant).jurisdictions
        return not allowed or jurisdiction in allowed

    def barred_here(self) -> frozenset[str]:
        """The configured tenants whose prompts may not enter at this router (door() refuses
        them): none with one router or a router without a site."""
        site = self.cfg.router.site
        if not self.cfg.routers or site is None:
            return frozenset()
        here = self.registry.jurisdiction.get(site, "")
        return frozenset(t.name for t in self.cfg.tenants if not self.reads_prompts_of(t.name, here))

    def door(self, tenant: str, api: str) -> None:
        """RouterError (CONSTRAINT) when ``tenant``'s prompts may not enter here: with several routers
        (``routers:``), this router's site is outside the tenant's jurisdictions. The message names the
        routers to use. The front ends ask before reading the request where their protocol allows (HTTP:
        before the body); nothing of it is tokenized, logged or forwarded, the refusal is audited."""
        site = self.cfg.router.site
        here = self.registry.jurisdiction.get(site or "", "")
        if not self.cfg.routers or site is None or self.reads_prompts_of(tenant, here):
            return
        allowed = self.tenants.of(tenant).jurisdictions
        better = [p for p in self.membership.peers() if self.reads_prompts_of(tenant, p.jurisdiction)]
        where = "; ".join(f"{p.name} ({p.site}, {p.jurisdiction}) at {p.address}" for p in better)
        exc = RouterError(ErrorKind.CONSTRAINT, f"tenant {tenant!r}'s prompts may enter only in "
                          f"{{{', '.join(sorted(allowed))}}}; this router ({self.membership.me.name}) is at {site} "
                          f"({here}) and did not read this request: send it to "
                          + (where or "a router there (none is live now)"))
        suppressed = self._refusals.allow()
        if suppressed is not None:
            self._audit({"api": api, "tenant": tenant, "router": self.membership.me.name, "site": site,
                         "outcome": exc.kind.value, "error": exc.message[:400], "suppressed_before": suppressed},
                        RecordKind.REFUSAL)
        raise exc

    def health(self) -> ipb.HealthResponse:
        p = len(self.registry.candidates(Role.PREFILL))
        d = len(self.registry.candidates(Role.DECODE))
        return ipb.HealthResponse(serving=d > 0, prefill_workers=p, decode_workers=d)

    async def generate(self, req: Request, caller: Caller,
                       msg: ipb.GenerateRequest | None = None) -> AsyncIterator[ipb.GenerateResponse]:
        """The answer to ``req``, message by message, within its tenant's quotas
        (over one: QuotaExceeded, an OVERLOADED RouterError naming it); every
        request ends with one audit record. ``msg``: the
        request as the client sent it (for a tenant whose prompts may be logged)."""
        policy = self.tenants.of(caller.tenant)
        record = self._record(msg or ipb.GenerateRequest(request_id=req.client_id), caller)
        record.admitted(req)
        record.fields["jurisdictions_requested"] = sorted(req.requested_jurisdictions or ()) or None
        record.resumed(req.resume, self.tok.decode(req.resume) if record.output is not None else None)
        # what it computes: its prompt, then the tokens it resumes after (prefilled as prompt), then its output
        computed = len(req.work.prompt_token_ids) + len(req.resume)
        cost = len(req.work.prompt_token_ids) + req.work.max_tokens
        error: BaseException | None = None
        grant = None
        obs = self.telemetry.observe(req, caller, self.limits.name)
        tickets = self.tickets.stream(req.binding, req.resume)
        try:
            grant = self.quotas.admit(policy, cost)
            recovery = Recovery(req.work)
            recovery.resume(req.resume)
            flight = Flight(req, caller, obs, recovery, AdmissionWait(self.cfg.router.admission, caller))
            async for out in self._attempts(flight):
                obs.message(out)
                record.saw(out)
                if out.token_ids:
                    out.resume_ticket = tickets.after(out.token_ids)
                yield out
        except BaseException as exc:
            error = exc
            raise
        finally:
            if grant is not None:
                self.quotas.release(grant, computed + record.completion)
            self._audit(record.record(error))
            obs.finish(error)

    async def _attempts(self, f: Flight) -> AsyncIterator[ipb.GenerateResponse]:
        """One attempt after another until the answer is complete. Each is placed as soon as
        a placement is possible (waiting for one when that can help); a worker failure
        (``Failover``) makes the next attempt (router/core/recovery.py) until none is left."""
        while True:
            work = f.run.work_request()
            if work is None:  # every token was sent before the decode worker failed
                yield f.run.finish_without_worker(f.req.client_id)
                return
            hashes = self._block_hashes(f.req, work)
            try:
                while True:
                    relay = await self._admitted(f, work, self._placement_request(f, work, hashes))
                    try:
                        async for msg in relay.run():
                            yield f.run.passed(msg)
                        return
                    except PlacementError as exc:  # the decode worker had no room after all (nothing was sent)
                        if not f.admission.allows(exc.wait):
                            raise refusal(exc) from None
                        await f.admission.pause()
            except Failover as fo:
                if fo.suspect:
                    self.registry.suspect(fo.worker_id)
                why = f.run.failed(fo)
                f.obs.attempt_failed(fo.stage, fo.worker_id, why)
                log.warning("%s: %s", f.req.client_id, why)
                if f.run.exhausted:
                    raise RouterError(ErrorKind.UNAVAILABLE, why) from None

    def _placement_request(self, f: Flight, work: wpb.WorkRequest, hashes: list[int]) -> PlacementRequest:
        """What placement is asked for this attempt: its prompt, the workers holding its leading
        blocks, the request's jurisdictions and deadline, the workers that failed it, the batch reserve."""
        return PlacementRequest(len(work.prompt_token_ids), self.registry.index.leading_blocks(hashes),
                                f.req.allowed_jurisdictions, f.caller.time_remaining(), frozenset(f.run.exclude),
                                f.run.colocated_only, f.caller.tenant,
                                (self.cfg.router.admission.interactive_reserve
                                 if f.caller.priority is Priority.BATCH else 0),
                                self.topology.lossy_ok(f.caller.tenant))

    async def _admitted(self, f: Flight, work: wpb.WorkRequest, preq: PlacementRequest) -> Relay:
        """A placement holding its workers' capacity: at once when there is room and
        nobody waits, else in the fair queue's order (router/core/admission.py)."""
        def try_place() -> Relay:
            t0 = time.time_ns()
            pl = place(preq, self.registry.view(), self.policy)
            return self._relay(f, work, pl, (t0, time.time_ns()))

        if not self.queue.waiting:
            try:
                return try_place()
            except PlacementError as exc:
                if not f.admission.allows(exc.wait):
                    raise refusal(exc) from None
        policy = self.tenants.of(f.caller.tenant)
        shed = self._shed_early(f, policy.priority.rank)
        if shed is not None:
            raise shed
        f.obs.waiting()
        ticket = self.queue.ticket(
            f.caller.tenant, policy.priority.rank, f.caller.priority is Priority.INTERACTIVE, policy.weight,
            preq.prompt_tokens + work.max_tokens,
            (preq.allowed_jurisdictions, self.registry.pools_of(f.caller.tenant), preq.exclude, preq.colocated_only,
             preq.reserve), try_place)
        try:
            return await self._turn(ticket, f.admission)
        except PlacementError as exc:
            raise refusal(exc) from None
        except asyncio.CancelledError:
            self.queue.withdraw(ticket)
            if ticket.future.done() and not ticket.future.cancelled() and ticket.future.exception() is None:
                ticket.future.result().release()  # placed just as its caller left
            raise

    def _shed_early(self, f: Flight, rank: int) -> RouterError | None:
        """Why ``f`` is refused now rather than queued (router.admission.shed_early): at the rate the queue
        has been served, its turn would come after it may wait. None: it waits."""
        if not self.cfg.router.admission.shed_early or not self.can_decode:
            return None  # no worker now: waiting for one is unavailable_wait_s's, not a queue to measure
        now = asyncio.get_running_loop().time()
        ahead = self.queue.ahead_of(rank, f.caller.priority is Priority.INTERACTIVE)
        expected = self.queue.expected_wait(ahead, now)
        may = f.admission.until[Wait.ROOM] - now
        if expected is None or expected[0] <= may:
            return None
        wait, rate = expected
        retry = min(SHED_RETRY_MAX_S, max(1.0, wait - may))
        return RouterError(ErrorKind.OVERLOADED, f"no room: {ahead} requests wait ahead of this one and the router "
                           f"serves about {rate:.2g} a second, so its turn would come in about {wait:.0f} s, after "
                           f"the {max(0.0, may):.0f} s it may wait; retry in {int(retry * 1e3)} ms",
                           retry_after_s=retry)

    async def _turn(self, ticket, admission: AdmissionWait) -> Relay:
        """Waits for ``ticket``'s placement within the admission wait of what it last lacked."""
        loop = asyncio.get_running_loop()
        while not ticket.future.done():
            wait = ticket.last_error.wait if ticket.last_error is not None else Wait.ROOM
            left = admission.until[wait] - loop.time()
            if left <= 0:
                self.queue.withdraw(ticket)
                raise ticket.last_error or PlacementError(PlacementFailure.CAPACITY, "no room", 1.0, Wait.ROOM)
            try:
                await asyncio.wait_for(asyncio.shield(ticket.future), min(left, 1.0))
            except TimeoutError:
                continue
        return ticket.future.result()

    def _relay(self, f: Flight, work: wpb.WorkRequest, pl: Placement, placed_ns: tuple[int, int]) -> Relay:
        """An attempt on placement ``pl``, holding its workers' capacity from now on."""
        d = self.registry.workers[pl.decode.worker_id]
        p = self.registry.workers[pl.prefill.worker_id] if pl.prefill is not None else None
        shown = placement_proto(pl.est_ttft_s, pl.policy, pl.cached_blocks_prefill, pl.cached_blocks_decode, p, d)
        relay = Relay(self._relaying, work, f.req.client_id, p, d, shown, f.caller,
                      span=f.obs.placed(pl, shown.link, placed_ns))
        relay.hold()
        return relay
