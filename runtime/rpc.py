"""gRPC plumbing every process shares: servers and channels with the
project's message limits. The one place where credentials attach to
connections (the trust issue adds TLS here)."""

from __future__ import annotations

import grpc

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
"""Message limits of every server and channel (a long prompt's token ids fit)."""


def create_server() -> grpc.aio.Server:
    """An asyncio gRPC server with the project's limits (not yet bound)."""
    return grpc.aio.server(options=GRPC_OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Binds ``server`` to ``host:port`` (0: any free port); returns the port.
    Raises OSError naming the address when it cannot be bound."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def aio_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel to another kvrelay process."""
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)


def sync_channel(address: str, max_send_bytes: int | None = None) -> grpc.Channel:
    """A blocking channel (CLI, launchers); ``max_send_bytes`` raises the send
    limit (a batch job's requests travel in one message)."""
    opts = dict(GRPC_OPTIONS)
    if max_send_bytes is not None:
        opts["grpc.max_send_message_length"] = max_send_bytes
    return grpc.insecure_channel(address, options=list(opts.items()))
