"""Who a gRPC call to the router comes from: the bearer token in its
metadata and the certificate its peer presented on the mutual-TLS listener
(none on the public one), named by router/core/auth.py's rules. Every servicer
of the router asks this before it does anything."""

from __future__ import annotations

import grpc

from kvrelay.router.core.auth import CallerAuth
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.requests import Caller, Priority
from kvrelay.runtime.config import ClusterConfig
from kvrelay.runtime.pki import Identity
from kvrelay.runtime.tls import PeerRefused, TLSMaterial
from kvrelay.runtime.tracing import TRACEPARENT

STATUS = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.UNKNOWN_MODEL: grpc.StatusCode.NOT_FOUND,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND, ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.CONSTRAINT: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED, ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
"""Each error kind's gRPC status."""


def authorization(context: grpc.aio.ServicerContext) -> str:
    """The call's ``authorization`` metadata ("" when absent)."""
    return metadata_value(context, "authorization")


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    """The call's metadata value for ``key`` ("" when absent or binary)."""
    value = dict(context.invocation_metadata() or ()).get(key, "")
    return value if isinstance(value, str) else ""


class GrpcCaller:
    """Who a gRPC call comes from: its token, and the certificate it
    presented on the mutual-TLS listener."""

    def __init__(self, cfg: ClusterConfig, tls: TLSMaterial | None) -> None:
        self.auth = CallerAuth(cfg)
        self.tls = tls

    def cert(self, context: grpc.aio.ServicerContext) -> Identity | None:
        """The caller's certificate identity; RouterError(UNAUTHENTICATED) when it is revoked."""
        if self.tls is None:
            return None
        try:
            return self.tls.peer(context)
        except PeerRefused as exc:
            raise RouterError(ErrorKind.UNAUTHENTICATED, exc.message) from None

    async def caller(self, context: grpc.aio.ServicerContext, priority: Priority = Priority.INTERACTIVE) -> Caller:
        """The tenant calling, with the call's deadline; raises RouterError."""
        how, cert = authorization(context), self.cert(context)
        await self.auth.ready(how)
        tenant = self.auth.tenant(how, cert)
        return Caller.with_timeout(tenant, context.time_remaining(), priority,
                                   credential=self.auth.credential(how, cert),
                                   traceparent=metadata_value(context, TRACEPARENT))

    async def operator(self, context: grpc.aio.ServicerContext) -> str:
        """The operator calling; raises RouterError."""
        await self.auth.ready(authorization(context))
        return self.auth.operator(authorization(context), self.cert(context))

    async def reader(self, context: grpc.aio.ServicerContext) -> tuple[str, str | None]:
        """Who reads usage or the statement: (operator, None) or (tenant, tenant); raises RouterError."""
        await self.auth.ready(authorization(context))
        return self.auth.reader(authorization(context), self.cert(context))
