"""A server interceptor that lets a call through only when its peer's
certificate has one of the allowed roles: the workers' listeners admit the
router and nobody else. The check runs before the servicer sees the request."""

from __future__ import annotations

import inspect

import grpc

from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.runtime.tls import PeerRefused, TLSMaterial, require_role


def _wrap_unary(behaviour, check):
    async def call(request, context):
        await check(context)
        return await behaviour(request, context)
    return call


def _wrap_stream(behaviour, check):
    if not inspect.isasyncgenfunction(behaviour):
        return _wrap_unary(behaviour, check)

    async def call(request, context):
        await check(context)
        async for item in behaviour(request, context):
            yield item
    return call


class PeerGate(grpc.aio.ServerInterceptor):
    """Admits calls from peers whose certificate has one of ``roles`` (and,
    with ``only``, names exactly one of those identities: a worker admits its
    deployment's routers, not every router certificate the CA signed)."""

    def __init__(self, tls: TLSMaterial, roles: tuple[CertRole, ...], only: frozenset[Identity] | None = None) -> None:
        self.tls = tls
        self.roles = roles
        self.only = only

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        try:
            ident = require_role(self.tls.peer(context), self.roles, "this worker")
        except PeerRefused as exc:
            await context.abort(exc.code, exc.message)
        if self.only is not None and ident not in self.only:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"this worker admits only its deployment's routers, "
                                f"{', '.join(sorted(str(i) for i in self.only))}; {ident} is another "
                                "(tls.router_identity, or routers:)")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        kinds = (("unary_unary", _wrap_unary, grpc.unary_unary_rpc_method_handler),
                 ("unary_stream", _wrap_stream, grpc.unary_stream_rpc_method_handler),
                 ("stream_unary", _wrap_unary, grpc.stream_unary_rpc_method_handler),
                 ("stream_stream", _wrap_stream, grpc.stream_stream_rpc_method_handler))
        for attr, wrap, make in kinds:
            behaviour = getattr(handler, attr)
            if behaviour is not None:
                return make(wrap(behaviour, self._check), request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler
