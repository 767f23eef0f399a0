"""The router: the public Inference service and the worker Registry.

Lifecycle of one Generate call: validate and tokenize (router/requests.py)
-> ask the prefix index what each worker caches of the prompt -> the
placement policy (router/placement.py) picks a decode worker D and a
prefill worker P, or colocated at D -> open D's Decode stream -> on D's reservation,
call P.Prefill with it as the KV target -> relay D's tokens to the client;
the last message carries usage and placement. Client cancellation cancels
both worker calls, which free their blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf.message import DecodeError
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

from engine.hashing import hash_blocks
from engine.tokenizer import Tokenizer
from router.admin import AdminService, BearerAuth, PoolManager
from router.placement import PlacementError, PlacementRequest, make_policy, place
from router.planner import Served
from router.recovery import Failover, Recovery
from router.registry import ROLE_NAMES, WorkerRecord, WorkerRegistry, link_name
from router.requests import ModelLimits, RequestError, build_work_request
from runtime.config import ClusterConfig

log = logging.getLogger(__name__)


PLACEMENT_CODES = {"constraint": grpc.StatusCode.FAILED_PRECONDITION,
                   "capacity": grpc.StatusCode.RESOURCE_EXHAUSTED,
                   "unavailable": grpc.StatusCode.UNAVAILABLE}


ADMISSION_BACKOFF_S = (0.05, 1.0)
"""First and longest pause of a request waiting at the router for a decode worker with room, or for one to come back."""


class WorkerFull(Exception):
    """The chosen decode worker had no KV blocks for the request (nothing was sent yet)."""


RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
"""Worker errors that another worker may not have (a crash, a failed transfer, a lease)."""


def _placement_proto(pl, p: WorkerRecord | None, d: WorkerRecord) -> ipb.Placement:
    """What the client is told of a placement (the measured fields are filled in later)."""
    return ipb.Placement(
        decode_worker=d.info.worker_id, decode_site=d.info.site, prefill_worker=(p or d).info.worker_id,
        prefill_site=(p or d).info.site, colocated=p is None, estimated_ttft_ms=pl.est_ttft_s * 1e3,
        policy=pl.policy, prefill_cached_blocks=pl.cached_blocks_prefill, decode_cached_blocks=pl.cached_blocks_decode,
        link="" if p is None else link_name(p.info.site, d.info.site))


class BadRequest:
    """Stands in for a request message that did not parse."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe_parse(data: bytes):
    try:
        return ipb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return BadRequest(f"request is not a valid GenerateRequest (is every string valid UTF-8?): {exc}")


class RouterService(igrpc.InferenceServicer, wgrpc.RegistryServicer):
    def __init__(self, cfg: ClusterConfig, tokenizer: Tokenizer, limits: ModelLimits,
                 policy_seed: int | None = None) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        self.limits = limits
        self.registry = WorkerRegistry(cfg)
        self.pools = PoolManager(cfg, self.registry)
        self.waiting_interactive = 0
        """Interactive requests waiting at the router for room (batch jobs hold back meanwhile)."""
        self.policy = make_policy(cfg.router.policy, policy_seed)
        self.clients = BearerAuth(cfg.auth.clients)
        """Tenants' credentials (auth.clients); none configured: no client authentication."""

    async def tenant(self, context) -> str:
        """Who is calling: the tenant of the call's bearer token ("" when no
        client credentials are configured). Aborts with UNAUTHENTICATED when
        they are required and missing or wrong. A call the router makes itself
        (a batch job's request) carries its tenant already."""
        known = getattr(context, "tenant", None)
        if known is not None or not self.clients.required:
            return known or ""
        return await self.clients.require(context, "client", "auth.clients")

    # -- Registry ------------------------------------------------------------
    async def Register(self, request: wpb.RegisterRequest, context) -> wpb.RegisterResponse:
        info = request.info
        if info.site not in self.registry.jurisdiction:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown site {info.site!r}")
        if info.role not in (wpb.ROLE_PREFILL, wpb.ROLE_DECODE):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be prefill or decode")
        await self.registry.register(info)
        log.info("worker %s registered at %s", info.worker_id, info.address)
        role = ROLE_NAMES[info.role]
        drained = self.pools.trim(info.site, role)  # a pool scaled down while this worker was starting
        if drained:
            log.info("%s/%s is above its desired size: draining %s", info.site, role, ", ".join(drained))
        return wpb.RegisterResponse(heartbeat_interval_s=self.cfg.router.heartbeat_interval_s)

    async def Heartbeat(self, request: wpb.HeartbeatRequest, context) -> wpb.HeartbeatResponse:
        return self.registry.heartbeat(request)

    async def Deregister(self, request: wpb.DeregisterRequest, context) -> wpb.DeregisterResponse:
        if await self.registry.deregister(request.worker_id):
            log.info("worker %s left", request.worker_id)
        return wpb.DeregisterResponse()

    async def ListWorkers(self, request, context) -> wpb.ListWorkersResponse:
        now = time.monotonic()
        reg = self.registry
        kv = self.cfg.kv
        links = [wpb.LinkStatus(name=reg.local_link.name, rtt_ms=reg.local_link.rtt_ms, gbps=reg.local_link.gbps,
                                up=True, transport=self.cfg.local_link.transport or kv.transport,
                                encrypt=self._encrypts(self.cfg.local_link))]
        for lc in self.cfg.links:
            key = frozenset(lc.between)
            lv, health = reg.links[key], reg.link_health[key]
            links.append(wpb.LinkStatus(
                name=lv.name, rtt_ms=lv.rtt_ms, gbps=lv.gbps, up=lv.up, transport=lc.transport or kv.transport,
                encrypt=self._encrypts(lc), down_reason=health.reason,
                changed_s_ago=now - health.changed_at if health.changed_at else 0.0))
        return wpb.ListWorkersResponse(workers=[
            wpb.WorkerStatus(info=w.info, load=w.load, healthy=reg.healthy(w), last_heartbeat_age_s=now - w.last_seen,
                             draining=w.draining, inflight=w.inflight,
                             cached_blocks=reg.index.blocks_of(w.info.worker_id))
            for w in sorted(reg.workers.values(), key=lambda w: w.info.worker_id)], links=links,
            policy=self.policy.name)

    # -- Inference -----------------------------------------------------------
    async def ListModels(self, request, context) -> ipb.ListModelsResponse:
        return ipb.ListModelsResponse(models=[ipb.ModelInfo(name=self.limits.name,
                                                            context_window=self.limits.max_model_len,
                                                            chat=self.tok.has_chat_template)])

    async def Health(self, request, context) -> ipb.HealthResponse:
        p = len(self.registry.candidates(wpb.ROLE_PREFILL))
        d = len(self.registry.candidates(wpb.ROLE_DECODE))
        return ipb.HealthResponse(serving=d > 0, prefill_workers=p, decode_workers=d)

    def placement_request(self, wr: wpb.WorkRequest, hashes: list, jurisdictions: list[str],
                          deadline_s: float | None, run: Recovery) -> PlacementRequest:
        """The placement question for one attempt: its size, what each worker
        caches of it (the prefix index, asked anew: caches change while a request
        waits), its constraints, deadline, and the workers that already failed it."""
        return PlacementRequest(len(wr.prompt_token_ids), self.registry.index.leading_blocks(hashes),
                                frozenset(jurisdictions) if jurisdictions else None, deadline_s,
                                frozenset(run.exclude), run.colocated_only)

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        tenant = await self.tenant(context)
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:  # each tenant's prompts hash into their own prefix-cache domain
            wr, _ = build_work_request(request, self.tok, self.limits, salt=tenant)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        client_id = request.request_id or wr.request_id
        remaining = context.time_remaining() or float("inf")
        loop = asyncio.get_running_loop()
        full_until = loop.time() + min(self.cfg.router.admission_wait_s, remaining)
        absent_until = loop.time() + min(self.cfg.router.unavailable_wait_s, remaining)
        backoff = ADMISSION_BACKOFF_S[0]
        run = Recovery(wr)
        attempt, hashes = None, []
        while True:
            if attempt is None:  # the first attempt, or the next after a failure
                attempt = run.work_request()
                if attempt is None:  # every token was sent before the decode worker failed
                    yield run.finish_without_worker(client_id)
                    return
                hashes = hash_blocks(attempt.prompt_token_ids, self.cfg.cache.block_size, attempt.salt)
            preq = self.placement_request(attempt, hashes, list(request.allowed_jurisdictions),
                                          context.time_remaining(), run)
            try:
                pl = place(preq, self.registry.view(), self.policy)
                d = self.registry.workers[pl.decode.worker_id]
                p = self.registry.workers[pl.prefill.worker_id] if pl.prefill is not None else None
                async for msg in self._relay(attempt, client_id, p, d, _placement_proto(pl, p, d), context):
                    yield run.passed(msg)
                return
            except Failover as f:
                if f.suspect:
                    self.registry.suspect(f.worker_id)
                attempt = None
                why = run.failed(f)
                log.warning("%s: %s", client_id, why)
                if run.exhausted:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, why)
                continue
            except (PlacementError, WorkerFull) as exc:
                full = isinstance(exc, WorkerFull) or (exc.kind == "capacity" and exc.full)
                absent = isinstance(exc, PlacementError) and exc.absent
                wait_until = full_until if full else absent_until if absent else 0.0
                if loop.time() + backoff < wait_until:
                    # capacity frees up as running requests finish, workers come back after a
                    # restart: wait for that (holding nothing), then place again
                    interactive = not getattr(context, "batch", False)
                    self.waiting_interactive += interactive
                    try:
                        await asyncio.sleep(backoff)
                    finally:
                        self.waiting_interactive -= interactive
                    backoff = min(ADMISSION_BACKOFF_S[1], backoff * 2)
                    continue
                if isinstance(exc, WorkerFull) or exc.kind == "capacity":
                    ms = max(1, int((exc.retry_after_s if isinstance(exc, PlacementError) else 1.0) * 1e3))
                    context.set_trailing_metadata((("retry-after-ms", str(ms)),))
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry in {ms} ms")
                await context.abort(PLACEMENT_CODES[exc.kind], exc.message)

    def _encrypts(self, link) -> bool:
        """A link's encryption: its own setting, else kv.encrypt."""
        return self.cfg.kv.encrypt if link.encrypt is None else link.encrypt

    def _link_target(self, target: wpb.KVTarget, p: WorkerRecord, d: WorkerRecord) -> wpb.KVTarget:
        """The decode worker's reservation plus what the link between P and D asks for."""
        link = self.registry.link_config(p.info.site, d.info.site)
        target.link_rtt_ms, target.link_gbps = link.rtt_ms, link.gbps
        target.encrypt = self._encrypts(link)
        # the sender's kind decides unless the link pins one (tcp = bytes over the socket)
        target.transport = link.transport or p.info.transport
        return target

    async def _relay(self, wr: wpb.WorkRequest, client_id: str, p: WorkerRecord | None, d: WorkerRecord,
                     placement: ipb.Placement, context: grpc.aio.ServicerContext):
        t0 = t_first = time.perf_counter()
        n_out = 0
        d.inflight += 1
        if p is not None:
            p.inflight += 1
        # prompt tokens this router has queued at the prefilling worker, known
        # at once (heartbeats lag); released with the first token
        prefiller, pending = p or d, len(wr.prompt_token_ids)
        prefiller.pending_prefill_tokens += pending
        call = d.stub.Decode(wpb.DecodeRequest(request=wr, colocated=p is None, lease_s=self.cfg.router.kv_lease_s))
        prefill: asyncio.Task | None = None
        read: asyncio.Task | None = None
        # KV crossing a link between sites: if the link goes down meanwhile, re-place at once
        # (the transfer would otherwise stall until its timeout)
        down = self.registry.link_down_event(p.info.site, d.info.site) if p is not None else None
        link_down = asyncio.ensure_future(down.wait()) if down is not None else None
        try:
            while True:
                read = read or asyncio.ensure_future(call.read())
                kv_moving = n_out == 0 and (prefill is None or not prefill.done())
                waiting = {read} if prefill is None or prefill.done() else {read, prefill}
                if link_down is not None and kv_moving:
                    waiting.add(link_down)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                kv_moving = n_out == 0 and (prefill is None or not prefill.done())  # (again: after the wait)
                if link_down is not None and link_down.done() and kv_moving and not read.done():
                    raise Failover("prefill", p.info.worker_id, f"link {placement.link} went down", suspect=False)
                if prefill is not None and prefill.done() and prefill.exception() is not None and not read.done():
                    exc = prefill.exception()
                    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.INTERNAL
                    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    if code in RETRYABLE:
                        raise Failover("prefill", p.info.worker_id, f"{code.name}: {details}")
                    await context.abort(code if code == grpc.StatusCode.INVALID_ARGUMENT else
                                        grpc.StatusCode.UNAVAILABLE, f"prefill failed: {details}")
                if not read.done():
                    continue
                ev, read = read.result(), None
                if ev is grpc.aio.EOF:
                    break
                if ev.HasField("reservation"):
                    target = self._link_target(ev.reservation, p, d)
                    placement.transport = target.transport
                    prefill = asyncio.ensure_future(p.stub.Prefill(wpb.PrefillRequest(request=wr, target=target)))
                    continue
                out = ev.output
                out.request_id = client_id
                if n_out == 0 and out.token_ids:
                    t_first = time.perf_counter()
                    placement.ttft_ms = (t_first - t0) * 1e3
                    prefiller.pending_prefill_tokens -= pending
                    pending = 0
                n_out += len(out.token_ids)
                if out.HasField("finish"):
                    if prefill is not None and not prefill.done() and out.token_ids:
                        # the prefill worker's figures come a little later: do not hold the tokens for them
                        early = ipb.GenerateResponse()
                        early.CopyFrom(out)
                        early.ClearField("finish")
                        yield early
                        for f in ("token_ids", "logprobs", "text"):
                            out.ClearField(f)
                    if prefill is not None:
                        try:
                            resp = await prefill
                        except grpc.aio.AioRpcError:  # every token is here; only P's figures are lost
                            resp = wpb.PrefillResponse()
                        placement.kv_bytes = resp.kv_bytes
                        placement.kv_transfer_ms, placement.prefill_ms = resp.transfer_ms, resp.prefill_ms
                        out.finish.usage.cached_prompt_tokens = max(out.finish.usage.cached_prompt_tokens,
                                                                    resp.cached_tokens)
                    out.finish.usage.completion_tokens = n_out
                    out.finish.placement.CopyFrom(placement)
                    if n_out:
                        now = time.perf_counter()
                        self.pools.window.add(Served(
                            time.monotonic(), prefiller.info.site, "prefill" if p is not None else "decode",
                            d.info.site, len(wr.prompt_token_ids), placement.ttft_ms / 1e3,
                            (now - t_first) / (n_out - 1) if n_out > 1 else None))
                yield out
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or "worker failed"
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and prefill is None and n_out == 0:
                raise WorkerFull(details) from None
            if code in RETRYABLE and (context.time_remaining() or 1.0) > 0:
                if p is not None and n_out == 0 and code in (grpc.StatusCode.ABORTED,
                                                              grpc.StatusCode.DEADLINE_EXCEEDED):
                    # D gave up on the KV (transfer failed, checksum, lease): the prefill side failed
                    raise Failover("prefill", p.info.worker_id, f"{code.name}: {details}") from None
                raise Failover("decode", d.info.worker_id, f"{code.name}: {details}") from None
            await context.abort(code, details)
        finally:
            d.inflight -= 1
            if p is not None:
                p.inflight -= 1
            prefiller.pending_prefill_tokens -= pending
            for t in (read, prefill, link_down):
                if t is not None and not t.done():
                    t.cancel()
            call.cancel()


def add_router_to_server(service: RouterService, server: grpc.aio.Server) -> None:
    """Registers both services; Generate parses its request leniently so a
    malformed message gets INVALID_ARGUMENT, not INTERNAL."""
    wgrpc.add_RegistryServicer_to_server(service, server)
    agrpc.add_AdminServicer_to_server(AdminService(service.cfg, service.pools), server)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_safe_parse,
            response_serializer=ipb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels, request_deserializer=ipb.ListModelsRequest.FromString,
            response_serializer=ipb.ListModelsResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            service.Health, request_deserializer=ipb.HealthRequest.FromString,
            response_serializer=ipb.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvrelay.v1.Inference", handlers),))
