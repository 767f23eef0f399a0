"""Outgoing TLS this process checks itself, for what gRPC cannot check: revoked serials.

gRPC's Python channels verify a server by the CA and the name its certificate
carries, with no hook for anything else (no verify callback, no CRL option:
grpc/grpc#32635). So while ``tls.revoked_serials`` lists any serial, a channel
(runtime/rpc.py ``Dialer``) does not dial the server itself: it dials a Unix
socket of this process's :class:`Forwarder`, in a folder only this process's
user may enter, and the forwarder carries each connection the channel opens
there over a TLS connection of its own to the real address (Python's ssl
module): the CA, the name and the dates are checked in the handshake, then the
server's serial against the revoked set, all before one byte of the channel
crosses. A refused server closes the channel's connection (the call fails
UNAVAILABLE) and the forwarder logs which serial it refused. With nothing
revoked, channels dial directly: there is nothing more to check.

The forwarder runs its own event loop on a daemon thread, one per process
(made again after a fork), with one local socket per server address the
process has dialed, kept for its life (a channel may reconnect through it at
any time): a router holds one per worker address it has known. Python's ssl module reads a certificate and key
from files only: they are written once, 0600, into the forwarder's private
folder, which is removed when the process exits."""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import shutil
import ssl
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from kvrelay.runtime.tls import TLSMaterial

log = logging.getLogger(__name__)

HANDSHAKE_S = 10.0
"""Deadline of a connection to the server, TLS handshake included."""
START_S = 10.0
"""Deadline for the forwarder's loop to open a new local socket."""
CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class Route:
    """One server as one kind of channel reaches it."""

    host: str
    port: int
    server_name: str | None
    """The name its certificate must carry (None: the host)."""
    material: TLSMaterial


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host, port); ValueError naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class Forwarder:
    """Local Unix sockets, one per route, whose connections it carries over checked TLS."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="kvrelay-tls-"))  # 0700
        atexit.register(shutil.rmtree, self.folder, True)
        self._routes: dict[Route, str] = {}
        self._contexts: dict[TLSMaterial, tuple[int, ssl.SSLContext]] = {}
        """Each material's client context, and the generation it was made from (remade after a renewal)."""
        self._lock = threading.Lock()
        self._contexts_lock = threading.Lock()  # apart: the loop's thread makes contexts while target() waits on it
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_quiet_at_exit)
        threading.Thread(target=self._loop.run_forever, daemon=True, name="checked-tls").start()

    def target(self, address: str, server_name: str | None, material: TLSMaterial) -> str:
        """The gRPC target (``unix:...``) that reaches ``address`` through the checks."""
        host, port = split_address(address)
        route = Route(host, port, server_name, material)
        with self._lock:
            path = self._routes.get(route)
            if path is None:
                path = str(self.folder / f"{len(self._routes)}.sock")
                started = asyncio.run_coroutine_threadsafe(
                    asyncio.start_unix_server(functools.partial(self._carry, route), path=path), self._loop)
                started.result(START_S)
                self._routes[route] = path
        return f"unix:{path}"

    def _context(self, material: TLSMaterial) -> ssl.SSLContext:
        """A client context that verifies servers by ``material``'s CA and presents its certificate
        (as the material is now: a new context after each renewal)."""
        with self._contexts_lock:
            made = self._contexts.get(material)
            if made is not None and made[0] == material.generation:
                return made[1]
            generation, pems = material.generation, material.pems
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=pems.ca_pem.decode())
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.set_alpn_protocols(["h2"])
            if pems.cert_pem is not None and pems.key_pem is not None:
                n = len(self._contexts)
                cert, key = self.folder / f"{n}.crt", self.folder / f"{n}.key"
                for path, pem in ((cert, pems.cert_pem), (key, pems.key_pem)):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(pem)
                ctx.load_cert_chain(cert, key)
            self._contexts[material] = (generation, ctx)
            return ctx

    async def _carry(self, route: Route, local_r: asyncio.StreamReader, local_w: asyncio.StreamWriter) -> None:
        """One connection of a channel: the checked TLS connection to the server, then bytes both ways."""
        name = route.server_name or route.host
        ctx = self._context(route.material)
        try:
            remote_r, remote_w = await asyncio.wait_for(asyncio.open_connection(
                route.host, route.port, ssl=ctx, server_hostname=name), HANDSHAKE_S)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError: a certificate gRPC would refuse too
            log.warning("TLS to %s:%d (%s) failed: %s", route.host, route.port, name, exc)
            local_w.close()
            return
        der = remote_w.get_extra_info("ssl_object").getpeercert(binary_form=True)
        serial = x509.load_der_x509_certificate(der).serial_number
        if serial in route.material.revoked:
            log.error("refused %s:%d (%s): its certificate serial %x is revoked (tls.revoked_serials); "
                      "nothing was sent to it", route.host, route.port, name, serial)
            remote_w.close()
            local_w.close()
            return
        await asyncio.gather(_pump(local_r, remote_w), _pump(remote_r, local_w))


def _quiet_at_exit(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's error handler: connections still carried when the process exits are not errors."""
    if context.get("message") == "Task was destroyed but it is pending!":
        return
    loop.default_exception_handler(context)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies until either side ends (a gRPC connection closes both ways at once), then closes ``writer``."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


_forwarder: tuple[int, Forwarder] | None = None
_made = threading.Lock()


def checked_target(address: str, server_name: str | None, material: TLSMaterial) -> str:
    """This process's forwarder's target for ``address`` (the forwarder made on first use)."""
    global _forwarder
    with _made:
        if _forwarder is None or _forwarder[0] != os.getpid():  # a forked child has no forwarder thread
            _forwarder = (os.getpid(), Forwarder())
        fwd = _forwarder[1]
    return fwd.target(address, server_name, material)
