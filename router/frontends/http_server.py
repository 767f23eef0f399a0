"""The HTTP server under the OpenAI API: uvicorn's HTTP/1.1 protocol (h11)
with the bounds a shared service needs against slow or greedy clients.

- **Header deadline**: a connection that has not sent a whole request head
  within ``header_timeout_s`` of connecting (or of its previous response) is
  closed; the TLS handshake has the same deadline.
- **Write deadline**: a client that stops reading for ``body_timeout_s``
  (the server's buffer to it full) is cut off.
- **Unread bodies**: a request answered without its body being read (401,
  413, 404, ...) is followed by a lingering close: what still arrives is
  discarded for ``LINGER_S`` and up to ``max_body_bytes``, so the client
  reads the answer instead of a reset, then the connection is closed.
- **Connection bounds**: at most ``max_connections`` open at once, and
  ``max_connections_per_client`` from one client address; a connection over
  either bound gets ``429`` (per client) or ``503`` (in all) in OpenAI's
  error shape, with ``Retry-After``, and is closed.

Body size and body deadline are the application's (router/frontends/openai_http.py
reads the body as a stream, after authenticating the caller)."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections import Counter
from dataclasses import dataclass, field

import h11
import uvicorn
from uvicorn.config import create_ssl_context
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvrelay.runtime.addresses import is_loopback
from kvrelay.runtime.config import HttpSection

READY_WAIT_S = 5.0
LINGER_S = 2.0
"""How long a connection answered before its body was read keeps discarding what still arrives."""
"""How long serve_http waits for uvicorn to start listening."""


def canned_error(status: int, reason: str, message: str, type_: str, retry_after_s: int) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape, for a connection refused before any request."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: {retry_after_s}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


@dataclass(slots=True)
class ConnectionCount:
    """Open connections, in all and per client address."""

    limits: HttpSection
    total: int = 0
    by_client: Counter = field(default_factory=Counter)

    def refusal(self, client: str) -> bytes | None:
        """None when one more connection from ``client`` is within the bounds, else the response refusing it."""
        if self.total >= self.limits.max_connections:
            return canned_error(503, "Service Unavailable", f"the server has {self.total} connections open, its "
                                f"limit; retry shortly", "service_unavailable", 1)
        if self.by_client[client] >= self.limits.max_connections_per_client:
            return canned_error(429, "Too Many Requests", f"{self.by_client[client]} connections are open from "
                                f"{client}, the limit per client address; close some or retry shortly",
                                "rate_limit_error", 1)
        return None

    def opened(self, client: str) -> None:
        self.total += 1
        self.by_client[client] += 1

    def closed(self, client: str) -> None:
        self.total -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a write deadline and
    connection bounds, counted from the moment a connection is accepted
    (TLS is started here, so a handshake in progress counts too)."""

    def __init__(self, *args, count: ConnectionCount, tls: ssl.SSLContext | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.count, self.tls = count, tls
        self.peer_host: str | None = None
        self.handshaking = False
        self.early = bytearray()
        """Bytes TLS decrypted before the handshake's end reached us."""
        self.head_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.linger_timer: asyncio.TimerHandle | None = None
        self.linger_budget = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) else str(peer)
        refused = self.count.refusal(host)
        if refused is not None:
            self.transport = transport
            if self.tls is None:  # on a TLS port the answer would need a handshake first
                transport.write(refused)
            transport.close()
            return
        self.peer_host = host
        self.count.opened(host)
        if self.tls is None:
            super().connection_made(transport)
            self._arm_head_timer()
            return
        transport.pause_reading()  # nothing reaches h11 before the handshake
        self.handshaking = True
        # held: a task nobody holds may vanish
        self.tls_task = self.loop.create_task(self._start_tls(transport, self.tls))

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        """The TLS handshake, within the header deadline; then HTTP over it."""
        try:
            tls = await self.loop.start_tls(raw, self, context, server_side=True,
                                            ssl_handshake_timeout=self.count.limits.header_timeout_s)
        except (TimeoutError, OSError, ssl.SSLError, ConnectionError, RuntimeError):
            tls = None
        if tls is None or self.peer_host is None:  # failed, timed out, or the peer left meanwhile
            self.handshaking = False
            raw.close()
            self._forget()
            return
        super().connection_made(tls)
        self._note_client_cert(tls)
        self.handshaking = False
        self._arm_head_timer()
        if self.early:  # what TLS delivered before start_tls returned to us
            early, self.early = bytes(self.early), bytearray()
            self.data_received(early)

    def _note_client_cert(self, tls: asyncio.Transport) -> None:
        """A certificate the client presented (the listener asks for one, optionally) reaches the
        app in each request's scope, as the ASGI TLS extension says: ``extensions.tls.client_cert_chain``."""
        ssl_object = tls.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if der:
            self.app = with_client_cert(self.app, ssl.DER_cert_to_PEM_cert(der))

    def _forget(self) -> None:
        if self.peer_host is not None:
            self.count.closed(self.peer_host)
            self.peer_host = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handshaking:  # the raw connection went before start_tls took it over
            self._forget()
            return
        if self.peer_host is None:  # refused in connection_made, or already forgotten
            return
        self._forget()
        self._disarm(("head_timer", "write_timer", "linger_timer"))
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.handshaking:
            self.early += data
            return
        if self.linger_timer is not None:
            self.linger_budget -= len(data)
            if self.linger_budget < 0:
                self._linger_over()
                return
        super().data_received(data)
        if self.linger_timer is not None and self.conn.their_state is not h11.SEND_BODY:
            self._disarm(("linger_timer",))  # the body ended: the connection may carry the next request
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # a (next) request head is still to come
        else:
            self._disarm(("head_timer",))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm(("head_timer",))  # keep-alive: uvicorn's idle timer runs until the next byte
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # answered before the body was read (401, 413, 404...): a lingering close. The rest
            # is discarded as it comes, for a while and up to a budget, so that the client, still
            # sending, is not reset before it reads the answer; then the connection is closed.
            self.linger_budget = self.count.limits.max_body_bytes
            self.linger_timer = self.loop.call_later(LINGER_S, self._linger_over)

    def pause_writing(self) -> None:
        """The client stopped reading: it has ``body_timeout_s`` to start again."""
        super().pause_writing()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(self.count.limits.body_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm(("write_timer",))

    def _linger_over(self) -> None:
        self._disarm(("linger_timer",))
        if not self.transport.is_closing():
            self.transport.close()

    def _stalled(self) -> None:
        self.write_timer = None
        if not self.transport.is_closing():
            self.transport.abort()

    def _arm_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.count.limits.header_timeout_s, self._head_late)

    def _disarm(self, names: tuple[str, ...]) -> None:
        for name in names:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

    def _head_late(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class GuardedServer(uvicorn.Server):
    """uvicorn's server listening on one socket with :class:`GuardedH11` connections."""

    def __init__(self, config: uvicorn.Config, limits: HttpSection) -> None:
        super().__init__(config)
        self.count = ConnectionCount(limits)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        config = self.config

        def protocol() -> GuardedH11:
            return GuardedH11(config=config, server_state=self.server_state, app_state=self.lifespan.state,
                              count=self.count, tls=config.ssl)

        loop = asyncio.get_running_loop()  # TLS starts in GuardedH11, after the connection is counted
        self.servers = [await loop.create_server(protocol, sock=s, backlog=config.backlog) for s in sockets or ()]
        self.started = True

    def reload_tls(self) -> None:
        """A new TLS context from the certificate, key and CA files (rewritten after a renewal):
        connections accepted from now on handshake with it; those open keep theirs. ssl.SSLError
        or OSError when the files cannot be used (the context stays as it was)."""
        c = self.config
        if c.ssl is None or not c.ssl_certfile:
            return
        c.ssl = create_ssl_context(keyfile=c.ssl_keyfile, certfile=c.ssl_certfile, password=None,
                                   ssl_version=c.ssl_version, cert_reqs=c.ssl_cert_reqs, ca_certs=c.ssl_ca_certs,
                                   ciphers=c.ssl_ciphers, alpn_protocols=getattr(GuardedH11, "alpn_protocols", None))


def with_client_cert(app, pem: str):
    """``app`` with the client's certificate (PEM) in every request's scope (``extensions.tls``)."""
    async def app_with_cert(scope, receive, send):
        scope.setdefault("extensions", {})["tls"] = {"client_cert_chain": [pem]}
        await app(scope, receive, send)
    return app_with_cert


async def serve_http(app, host: str, port: int, tls_files: tuple[str, str] | None,
                     limits: HttpSection, client_ca: str | None = None) -> tuple[GuardedServer, asyncio.Task, int]:
    """Starts the server on ``host:port`` (0: any free port) in this event loop,
    over TLS with ``tls_files`` (certificate and key files), in plaintext
    without (loopback only); returns the server, its task and the bound port.
    ``client_ca``: a CA file whose client certificates the handshake asks for (optionally)
    and verifies; each reaches the app in its requests' scope (:func:`with_client_cert`)."""
    if tls_files is None and not is_loopback(host):
        raise OSError(f"refusing to serve HTTP in plaintext on {host}:{port} (not a loopback address)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (an accepted
    # socket inherits the listener's), and without it each response's second write waited for the
    # client's delayed ACK (~40 ms per response, measured; benchmarks/RESULTS.md)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    client_ca = client_ca if tls_files else None
    server = GuardedServer(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, http="h11",
                                          ws="none",
                                          timeout_graceful_shutdown=2, backlog=limits.max_connections,
                                          ssl_certfile=tls_files[0] if tls_files else None,
                                          ssl_keyfile=tls_files[1] if tls_files else None,
                                          ssl_ca_certs=client_ca,
                                          ssl_cert_reqs=ssl.CERT_OPTIONAL if client_ca else ssl.CERT_NONE),
                           limits)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    loop = asyncio.get_running_loop()
    until = loop.time() + READY_WAIT_S
    while not (server.started or task.done()) and loop.time() < until:
        await asyncio.sleep(0.025)
    if not server.started:
        if task.done() and task.exception() is not None:
            raise RuntimeError(f"HTTP server did not start on {host}:{port}: {task.exception()}")
        raise RuntimeError(f"HTTP server did not start on {host}:{port} within {READY_WAIT_S:.0f} s")
    return server, task, sock.getsockname()[1]
