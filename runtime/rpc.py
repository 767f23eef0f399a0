"""gRPC plumbing every process shares: servers and channels with the
project's message limits, and the one place where TLS attaches to them.

A listener is bound with the process's :class:`~runtime.tls.TLSMaterial`:
server-only TLS (public: clients present bearer tokens) or mutual TLS
(internal: the peer presents a certificate from the cluster CA). A channel is
made by a :class:`Dialer`, which holds what this process presents (its
certificate, a bearer token) and pins the name the server's certificate must
carry. Plaintext exists only with ``tls.enabled: false``, and only on
loopback addresses."""

from __future__ import annotations

from dataclasses import dataclass, replace

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvrelay.runtime.addresses import is_loopback
from kvrelay.runtime.checked_tls import checked_target
from kvrelay.runtime.tls import TLSMaterial

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
"""Message limits of every server and channel (a long prompt's token ids fit)."""


def create_server(interceptors=(), max_receive_bytes: int | None = None,
                  max_concurrent_rpcs: int | None = None) -> grpc.aio.Server:
    """An asyncio gRPC server with the project's limits (not yet bound);
    ``max_receive_bytes`` lowers the largest message it takes (a public
    listener's), ``max_concurrent_rpcs`` bounds the calls it serves at once
    (more get RESOURCE_EXHAUSTED)."""
    options = dict(GRPC_OPTIONS)
    if max_receive_bytes is not None:
        options["grpc.max_receive_message_length"] = max_receive_bytes
    return grpc.aio.server(options=list(options.items()), interceptors=tuple(interceptors),
                           maximum_concurrent_rpcs=max_concurrent_rpcs)


def bind(server: grpc.aio.Server, host: str, port: int, tls: TLSMaterial | None, mutual: bool = False) -> int:
    """Binds ``server`` to ``host:port`` (0: any free port) with TLS (mutual
    when ``mutual``), or in plaintext when ``tls`` is None, which only a
    loopback host may do. Returns the port; OSError naming the address when
    it cannot be bound."""
    if tls is None:
        if not is_loopback(host):
            raise OSError(f"refusing to listen in plaintext on {host}:{port} (not a loopback address): turn TLS on")
        # gRPC's local credentials: plaintext that only loopback peers may use, and that carries tokens
        local = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        bound = server.add_secure_port(f"{host}:{port}", local)
    else:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials(mutual))
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def _call_token(token: str):
    """Call credentials that add ``authorization: Bearer <token>`` to every call."""
    return grpc.access_token_call_credentials(token)


@dataclass(frozen=True, slots=True)
class Dialer:
    """How this process connects to others."""

    tls: TLSMaterial | None = None
    """CA to verify servers by, and our certificate; None: plaintext on
    loopback (tls.enabled: false), through gRPC's local credentials. With
    revoked serials, channels reach servers through runtime/checked_tls.py,
    which refuses a revoked server's certificate (gRPC has no hook for it)."""
    token: str | None = None
    """Bearer token sent with every call."""

    def with_token(self, token: str | None) -> Dialer:
        return replace(self, token=token)

    def _args(self, address: str, server_name: str | None, options: list) -> tuple:
        if self.tls is None:
            creds = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
            server_name = None
        elif self.tls.revoked:  # gRPC cannot refuse a revoked server: this process's forwarder does
            address = checked_target(address, server_name, self.tls)
            creds = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
            server_name = None
        else:
            creds = self.tls.channel_credentials()
        if self.token:
            creds = grpc.composite_channel_credentials(creds, _call_token(self.token))
        if server_name:
            options = [*options, ("grpc.ssl_target_name_override", server_name)]
        return (address, creds), {"options": options}

    def aio(self, address: str, server_name: str | None = None, options: tuple = ()) -> grpc.aio.Channel:
        """An asyncio channel; ``server_name``: the name the server's
        certificate must carry instead of the address's host; ``options``:
        more channel options (reconnect backoff, say)."""
        args, kw = self._args(address, server_name, [*GRPC_OPTIONS, *options])
        return grpc.aio.secure_channel(*args, **kw)

    def sync(self, address: str, server_name: str | None = None, max_send_bytes: int | None = None) -> grpc.Channel:
        """A blocking channel (CLI, launchers); ``max_send_bytes`` raises the
        send limit (a batch job's requests travel in one message)."""
        opts = dict(GRPC_OPTIONS)
        if max_send_bytes is not None:
            opts["grpc.max_send_message_length"] = max_send_bytes
        args, kw = self._args(address, server_name, list(opts.items()))
        return grpc.secure_channel(*args, **kw)


PLAINTEXT = Dialer()
"""Channels without TLS (``tls.enabled: false`` only)."""


@dataclass(frozen=True, slots=True)
class BadRequest:
    """Stands in for a request message that did not parse."""

    reason: str


def _lenient(cls, what: str):
    """A deserializer that returns BadRequest where ``cls.FromString`` raises."""
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return BadRequest(f"request is not a valid {what} (is every string valid UTF-8?): {exc}")
    return parse


def _refusing(behavior, streaming: bool):
    """``behavior`` behind a check: a BadRequest ends the call with INVALID_ARGUMENT."""
    if streaming:
        async def stream(request, context):
            if isinstance(request, BadRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            async for msg in behavior(request, context):
                yield msg
        return stream

    async def unary(request, context):
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await behavior(request, context)
    return unary


@dataclass(slots=True)
class CallBounds:
    """The public listener's bounds, applied per call on a listener that also serves callers
    who need more (the router's internal one: workers' registrations and heartbeats are
    ``exempt``; tenants' and operators' calls there get these)."""

    max_message_bytes: int
    """Largest request message taken (RESOURCE_EXHAUSTED above it)."""
    max_concurrent: int
    """Bounded calls served at once; more get RESOURCE_EXHAUSTED."""
    exempt: frozenset[str] = frozenset()
    """Full method names (``/kvrelay.v1.Registry/Heartbeat``) not bounded."""
    inflight: int = 0

    async def admit(self, request, context: grpc.aio.ServicerContext) -> None:
        """Aborts the call when its message or the calls in flight are over the bounds; else counts it."""
        size = request.ByteSize() if hasattr(request, "ByteSize") else 0
        if size > self.max_message_bytes:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request of {size} bytes is over the "
                                f"{self.max_message_bytes} this listener takes from tenants and operators "
                                "(router.api.max_message_bytes)")
        if self.inflight >= self.max_concurrent:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_concurrent} calls of tenants and "
                                "operators in progress on this listener (router.api.max_concurrent_rpcs); retry")
        self.inflight += 1

    def wrap(self, behavior, streaming: bool):
        """``behavior`` admitted by :meth:`admit`, counted while it runs."""
        if streaming:
            async def stream(request, context):
                await self.admit(request, context)
                try:
                    async for msg in behavior(request, context):
                        yield msg
                finally:
                    self.inflight -= 1
            return stream

        async def unary(request, context):
            await self.admit(request, context)
            try:
                return await behavior(request, context)
            finally:
                self.inflight -= 1
        return unary


def add_service(server: grpc.aio.Server, servicer, service: ServiceDescriptor,
                bounds: CallBounds | None = None) -> None:
    """Registers ``servicer`` as ``service`` (a generated file's
    ``DESCRIPTOR.services_by_name[...]``), as the generated
    ``add_*Servicer_to_server`` would, except that a request message that
    does not parse (bad wire format, a string that is not UTF-8) gets
    INVALID_ARGUMENT naming the message rather than gRPC's INTERNAL. With
    ``bounds``, every method it does not exempt is bounded by it."""
    handlers = {}
    for m in service.methods:
        if m.client_streaming:
            raise ValueError(f"{service.full_name}.{m.name}: client streaming is not supported here")
        request, response = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        behavior = _refusing(getattr(servicer, m.name), m.server_streaming)
        if bounds is not None and f"/{service.full_name}/{m.name}" not in bounds.exempt:
            behavior = bounds.wrap(behavior, m.server_streaming)
        handlers[m.name] = make(behavior,
                                request_deserializer=_lenient(request, m.input_type.name),
                                response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
