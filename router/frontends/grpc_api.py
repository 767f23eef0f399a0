"""The public gRPC API (``kvrelay.v1.Inference``), a thin adapter over the
router core: it establishes the caller (tenant from the bearer token,
deadline from the call), hands the request to :class:`~kvrelay.router.core.pipeline.RouterCore`,
streams its messages, and maps a :class:`~kvrelay.router.core.errors.RouterError` to a
gRPC status (with ``retry-after-ms`` trailing metadata when overloaded).

``add_router_to_server`` registers it with the worker Registry
(router/frontends/registry_service.py) and the Admin API (router/frontends/admin.py)."""

from __future__ import annotations

from typing import NoReturn

import grpc

from kvrelay.router.core.errors import RouterError
from kvrelay.router.core.pipeline import RouterCore
from kvrelay.router.core.records import Auditor
from kvrelay.router.frontends.admin import AdminService
from kvrelay.router.frontends.peer import STATUS, GrpcCaller, authorization
from kvrelay.router.frontends.registry_service import RegistryService
from kvrelay.runtime.rpc import CallBounds, add_service
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb


async def abort(context: grpc.aio.ServicerContext, exc: RouterError, prefix: str = "") -> NoReturn:
    """Ends the call with the error's status (and retry hint)."""
    if exc.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(max(1, int(exc.retry_after_s * 1e3)))),))
    await context.abort(STATUS[exc.kind], prefix + exc.message)


class InferenceService(igrpc.InferenceServicer):
    """``kvrelay.v1.Inference`` over the router core."""

    def __init__(self, core: RouterCore, auth: GrpcCaller) -> None:
        self.core = core
        self.auth = auth

    async def Generate(self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            try:
                caller = await self.auth.caller(context)
            except RouterError as exc:
                self.core.audit_refused("grpc", exc, "token" if authorization(context) else "none")
                raise
            self.core.door(caller.tenant, "grpc")
            req = await self.core.admit(request, caller)
            async for msg in self.core.generate(req, caller, request):
                yield msg
        except RouterError as exc:
            await abort(context, exc)

    async def ListModels(self, request, context) -> ipb.ListModelsResponse:
        try:
            await self.auth.caller(context)
        except RouterError as exc:
            await abort(context, exc)
        lim = self.core.limits
        return ipb.ListModelsResponse(models=[ipb.ModelInfo(name=lim.name, context_window=lim.max_model_len,
                                                            chat=lim.chat)])

    async def Health(self, request, context) -> ipb.HealthResponse:
        return self.core.health()

    async def ListRouters(self, request, context) -> ipb.ListRoutersResponse:
        """The live routers and their sites (no credentials: clients ask before choosing one)."""
        m = self.core.membership
        out = ipb.ListRoutersResponse(routers=m.peers(), answered_by=m.me.name)
        try:
            tenant = (await self.auth.caller(context)).tenant
        except RouterError:  # no credential, or not a tenant's: the list alone
            return out
        out.yours.extend(p.name for p in out.routers if self.core.reads_prompts_of(tenant, p.jurisdiction))
        return out


def add_router_to_server(core: RouterCore, server: grpc.aio.Server, auth: GrpcCaller, audit: Auditor | None,
                         bounds: CallBounds | None = None) -> None:
    """Registers the Inference, Registry and Admin services (``audit``: where registrations and
    operator actions are recorded; ``bounds``: on every call but a worker's own registry calls);
    every request message parses leniently, so a malformed one gets INVALID_ARGUMENT, not INTERNAL."""
    add_service(server, RegistryService(core, auth, audit), wpb.DESCRIPTOR.services_by_name["Registry"], bounds)
    add_service(server, AdminService(core, auth, audit), apb.DESCRIPTOR.services_by_name["Admin"], bounds)
    add_service(server, InferenceService(core, auth), ipb.DESCRIPTOR.services_by_name["Inference"], bounds)


WORKER_CALLS = frozenset(f"/kvrelay.v1.Registry/{m}" for m in ("Register", "Heartbeat", "Deregister"))
"""What only workers call: unbounded on the internal listener (a heartbeat carries a worker's prefix index)."""
