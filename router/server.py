"""The router: the public Inference service and the worker Registry.

Lifecycle of one Generate call: validate and tokenize (router/requests.py)
-> pick a decode worker D and a prefill worker P (colocated at D when no
prefill worker qualifies) -> open D's Decode stream -> on D's reservation,
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

from cluster.config import ClusterConfig
from engine.tokenizer import Tokenizer
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from router.registry import WorkerRecord, WorkerRegistry
from router.requests import ModelLimits, RequestError, build_work_request

log = logging.getLogger(__name__)


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
    def __init__(self, cfg: ClusterConfig, tokenizer: Tokenizer, limits: ModelLimits) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        self.limits = limits
        self.registry = WorkerRegistry(cfg.router.worker_timeout_s)
        self.site_jurisdiction = {s.name: s.jurisdiction for s in cfg.sites}

    # -- Registry ------------------------------------------------------------
    async def Register(self, request: wpb.RegisterRequest, context) -> wpb.RegisterResponse:
        info = request.info
        if info.site not in self.site_jurisdiction:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown site {info.site!r}")
        if info.role not in (wpb.ROLE_PREFILL, wpb.ROLE_DECODE):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be prefill or decode")
        await self.registry.register(info)
        log.info("worker %s registered at %s", info.worker_id, info.address)
        return wpb.RegisterResponse(heartbeat_interval_s=self.cfg.router.heartbeat_interval_s)

    async def Heartbeat(self, request: wpb.HeartbeatRequest, context) -> wpb.HeartbeatResponse:
        return wpb.HeartbeatResponse(known=self.registry.heartbeat(request.load))

    async def ListWorkers(self, request, context) -> wpb.ListWorkersResponse:
        now = time.monotonic()
        return wpb.ListWorkersResponse(workers=[
            wpb.WorkerStatus(info=w.info, load=w.load, healthy=self.registry.healthy(w),
                             last_heartbeat_age_s=now - w.last_seen)
            for w in sorted(self.registry.workers.values(), key=lambda w: w.info.worker_id)])

    # -- Inference -----------------------------------------------------------
    async def ListModels(self, request, context) -> ipb.ListModelsResponse:
        return ipb.ListModelsResponse(models=[ipb.ModelInfo(name=self.limits.name,
                                                            context_window=self.limits.max_model_len,
                                                            chat=self.tok.has_chat_template)])

    async def Health(self, request, context) -> ipb.HealthResponse:
        p = len(self.registry.candidates(wpb.ROLE_PREFILL))
        d = len(self.registry.candidates(wpb.ROLE_DECODE))
        return ipb.HealthResponse(serving=d > 0, prefill_workers=p, decode_workers=d)

    def _allowed_sites(self, jurisdictions: list[str]) -> set[str] | None:
        if not jurisdictions:
            return None
        return {s for s, j in self.site_jurisdiction.items() if j in set(jurisdictions)}

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            wr, _ = build_work_request(request, self.tok, self.limits)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        client_id = request.request_id or wr.request_id
        sites = self._allowed_sites(list(request.allowed_jurisdictions))
        d = self.registry.pick(wpb.ROLE_DECODE, sites)
        if d is None:
            if sites is not None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"no decode worker in jurisdictions {list(request.allowed_jurisdictions)}")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker is registered")
        p = self.registry.pick(wpb.ROLE_PREFILL, sites)
        async for msg in self._relay(wr, client_id, p, d, context):
            yield msg

    async def _relay(self, wr: wpb.WorkRequest, client_id: str, p: WorkerRecord | None, d: WorkerRecord,
                     context: grpc.aio.ServicerContext):
        placement = ipb.Placement(decode_worker=d.info.worker_id, decode_site=d.info.site,
                                  prefill_worker=(p or d).info.worker_id, prefill_site=(p or d).info.site,
                                  colocated=p is None, transport="" if p is None else p.info.transport)
        t0 = time.perf_counter()
        n_out = 0
        d.inflight += 1
        if p is not None:
            p.inflight += 1
        call = d.stub.Decode(wpb.DecodeRequest(request=wr, colocated=p is None, lease_s=self.cfg.router.kv_lease_s))
        prefill: asyncio.Task | None = None
        read: asyncio.Task | None = None
        try:
            while True:
                read = read or asyncio.ensure_future(call.read())
                waiting = {read} if prefill is None or prefill.done() else {read, prefill}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if prefill is not None and prefill.done() and prefill.exception() is not None and not read.done():
                    exc = prefill.exception()
                    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.INTERNAL
                    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    await context.abort(code if code == grpc.StatusCode.INVALID_ARGUMENT else
                                        grpc.StatusCode.UNAVAILABLE, f"prefill failed: {details}")
                if not read.done():
                    continue
                ev, read = read.result(), None
                if ev is grpc.aio.EOF:
                    break
                if ev.HasField("reservation"):
                    prefill = asyncio.ensure_future(p.stub.Prefill(wpb.PrefillRequest(request=wr,
                                                                                       target=ev.reservation)))
                    continue
                out = ev.output
                out.request_id = client_id
                if n_out == 0 and out.token_ids:
                    placement.ttft_ms = (time.perf_counter() - t0) * 1e3
                n_out += len(out.token_ids)
                if out.HasField("finish"):
                    if prefill is not None:
                        resp = await prefill
                        placement.kv_bytes = resp.kv_bytes
                        out.finish.usage.cached_prompt_tokens = max(out.finish.usage.cached_prompt_tokens,
                                                                    resp.cached_tokens)
                    out.finish.usage.completion_tokens = n_out
                    out.finish.placement.CopyFrom(placement)
                yield out
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "worker failed")
        finally:
            d.inflight -= 1
            if p is not None:
                p.inflight -= 1
            for t in (read, prefill):
                if t is not None and not t.done():
                    t.cancel()
            call.cancel()


def add_router_to_server(service: RouterService, server: grpc.aio.Server) -> None:
    """Registers both services; Generate parses its request leniently so a
    malformed message gets INVALID_ARGUMENT, not INTERNAL."""
    wgrpc.add_RegistryServicer_to_server(service, server)
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
