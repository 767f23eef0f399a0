"""``kvrelay bench handshakes``: what renewable listeners cost a new connection.

Every kvrelay listener takes its certificate through gRPC's dynamic server
credentials (runtime/tls.py ``TLSMaterial.server_credentials``): gRPC asks a
Python callback before each TLS handshake whether the material changed. This
measures that against gRPC's static credentials in one run, on loopback, in
this process: three servers of the same certificate (static; dynamic;
dynamic with the material renewed every ``renew_every`` handshakes, so that
the callback hands gRPC a new configuration that often), each answering a
unary call; clients open a new channel per call (a full TLS handshake each),
taking turns between the servers so that all three meet the same machine
load. Results are the p50 and p90 of a call on a new channel; the JSON field
names are stable."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass

import grpc

from kvrelay.runtime.pki import CertRole, Identity, issue, new_ca
from kvrelay.runtime.tls import Pems, TLSMaterial

MODES = ("static", "dynamic", "renewing")
IDENT = Identity("local", CertRole.ROUTER, "bench")


@dataclass(slots=True)
class HandshakeResult:
    connections: int
    """New channels per mode (one call each)."""
    renew_every: int
    static_p50_ms: float
    static_p90_ms: float
    dynamic_p50_ms: float
    dynamic_p90_ms: float
    renewing_p50_ms: float
    renewing_p90_ms: float

    @property
    def dynamic_overhead_pct(self) -> float:
        return 100.0 * (self.dynamic_p50_ms / self.static_p50_ms - 1.0)

    @property
    def renewing_overhead_pct(self) -> float:
        return 100.0 * (self.renewing_p50_ms / self.static_p50_ms - 1.0)

    def to_dict(self) -> dict:
        return asdict(self) | {"dynamic_overhead_pct": self.dynamic_overhead_pct,
                               "renewing_overhead_pct": self.renewing_overhead_pct}


async def _echo(request: bytes, context) -> bytes:
    return request


async def _server(creds: grpc.ServerCredentials) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(_echo)}),))
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


async def _call_ms(port: int, ca_pem: bytes) -> float:
    t0 = time.perf_counter()
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca_pem),
                                       options=[("grpc.ssl_target_name_override", "router.kvrelay")]) as ch:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary("/bench.Echo/Call")
        await call(b"x", timeout=10)
    return (time.perf_counter() - t0) * 1e3


def _p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


async def _run(connections: int, renew_every: int, warmup: int) -> HandshakeResult:
    ca = new_ca()
    pairs = [issue(ca, IDENT, hosts=("127.0.0.1",)) for _ in range(2)]
    static = grpc.ssl_server_credentials([(pairs[0][1], pairs[0][0])], root_certificates=ca.pem)
    dynamic = TLSMaterial(ca.pem, pairs[0][0], pairs[0][1], IDENT)
    renewing = TLSMaterial(ca.pem, pairs[0][0], pairs[0][1], IDENT)
    servers = dict(zip(MODES, [await _server(static), await _server(dynamic.server_credentials(False)),
                               await _server(renewing.server_credentials(False))], strict=True))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for i in range(warmup + connections):
            if i % renew_every == 0:
                cert, key = pairs[(i // renew_every) % 2]
                renewing.renew(Pems(ca.pem, cert, key, IDENT))
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                ms = await _call_ms(servers[mode][1], ca.pem)
                if i >= warmup:
                    times[mode].append(ms)
    finally:
        for server, _ in servers.values():
            await server.stop(None)
    stats = [v for m in MODES for v in (statistics.median(times[m]), _p90(times[m]))]
    return HandshakeResult(connections, renew_every, *stats)


def run_handshake_bench(connections: int = 300, renew_every: int = 10, warmup: int = 20) -> HandshakeResult:
    """The three servers up, ``connections`` new channels to each (taking turns), then stopped."""
    if connections < 1 or renew_every < 1:
        raise ValueError("connections and renew_every must be at least 1")
    return asyncio.run(_run(connections, renew_every, warmup))


def format_handshakes(r: HandshakeResult) -> str:
    rows = [f"a unary call on a new TLS channel, {r.connections} per server (taking turns); 'renewing': the "
            f"material renewed every {r.renew_every} handshakes",
            f"{'':10} {'p50':>9} {'p90':>9}"]
    for mode in MODES:
        rows.append(f"{mode:10} {getattr(r, f'{mode}_p50_ms'):7.2f}ms {getattr(r, f'{mode}_p90_ms'):7.2f}ms")
    rows.append(f"dynamic credentials add {r.dynamic_overhead_pct:+.1f}% to p50 ({r.renewing_overhead_pct:+.1f}% "
                "while renewing)")
    return "\n".join(rows)
