"""The public gRPC API (``kvrelay.v1.Inference``), a thin adapter over the
router core: it establishes the caller (tenant from the bearer token,
deadline from the call), hands the request to :class:`~router.core.RouterCore`,
streams its messages, and maps a :class:`~router.errors.RouterError` to a
gRPC status (with ``retry-after-ms`` trailing metadata when overloaded).

``add_router_to_server`` registers it with the worker Registry
(router/registry_service.py) and the Admin API (router/admin.py)."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2_grpc as wgrpc

from router.admin import AdminService
from router.core import RouterCore
from router.errors import ErrorKind, RouterError
from router.peer import STATUS, CallAuth
from router.registry_service import RegistryService


async def abort(context: grpc.aio.ServicerContext, exc: RouterError, prefix: str = ""):
    """Ends the call with the error's status (and retry hint)."""
    if exc.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(max(1, int(exc.retry_after_s * 1e3)))),))
    await context.abort(STATUS[exc.kind], prefix + exc.message)


class BadRequest:
    """Stands in for a request message that did not parse."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe_parse(data: bytes) -> ipb.GenerateRequest | BadRequest:
    try:
        return ipb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return BadRequest(f"request is not a valid GenerateRequest (is every string valid UTF-8?): {exc}")


class InferenceService(igrpc.InferenceServicer):
    """``kvrelay.v1.Inference`` over the router core."""

    def __init__(self, core: RouterCore, auth: CallAuth) -> None:
        self.core = core
        self.auth = auth

    async def Generate(self, request: ipb.GenerateRequest | BadRequest, context: grpc.aio.ServicerContext):
        try:
            caller = self.auth.caller(context)
            if isinstance(request, BadRequest):
                raise RouterError(ErrorKind.INVALID, request.reason)
            req = self.core.prepare(request, caller)
            async for msg in self.core.generate(req, caller):
                yield msg
        except RouterError as exc:
            await abort(context, exc)

    async def ListModels(self, request, context) -> ipb.ListModelsResponse:
        try:
            self.auth.caller(context)
        except RouterError as exc:
            await abort(context, exc)
        lim = self.core.limits
        return ipb.ListModelsResponse(models=[ipb.ModelInfo(name=lim.name, context_window=lim.max_model_len,
                                                            chat=lim.chat)])

    async def Health(self, request, context) -> ipb.HealthResponse:
        return self.core.health()


def add_router_to_server(core: RouterCore, server: grpc.aio.Server, auth: CallAuth) -> None:
    """Registers the Inference, Registry and Admin services; Generate parses its
    request leniently so a malformed message gets INVALID_ARGUMENT, not INTERNAL."""
    wgrpc.add_RegistryServicer_to_server(RegistryService(core, auth), server)
    agrpc.add_AdminServicer_to_server(AdminService(core.pools, auth), server)
    inference = InferenceService(core, auth)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            inference.Generate, request_deserializer=_safe_parse,
            response_serializer=ipb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            inference.ListModels, request_deserializer=ipb.ListModelsRequest.FromString,
            response_serializer=ipb.ListModelsResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            inference.Health, request_deserializer=ipb.HealthRequest.FromString,
            response_serializer=ipb.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvrelay.v1.Inference", handlers),))
