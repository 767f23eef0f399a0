"""Revoked certificates on outgoing connections (issue 33, finding 3): someone
holding a revoked certificate's key, on-path at an address a process dials,
receives nothing. The router dialing a decode worker (its address taken over
after the worker died), a worker dialing the router and the CLI dialing the
router each refuse a server whose serial is in ``tls.revoked_serials`` (the
CLI: ``--revoked``) before the first byte of a call; a server with a valid
certificate of the same identity is reached as before."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys

import grpc
import pytest
from cryptography import x509

from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.pki import CertRole, Identity, issue, new_ca, role_dns
from kvrelay.runtime.rpc import Dialer
from kvrelay.runtime.tls import TLSMaterial, parse_serials
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import CLUSTER_YAML, wait_until, workers

pytestmark = pytest.mark.model

REACHED = grpc.StatusCode.DATA_LOSS
"""What a recording server answers every call it receives (the test tells it from a refused connection)."""


class Recorder(grpc.GenericRpcHandler):
    """Records every call it is sent (method, request bytes), then fails it with REACHED."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    def service(self, details):
        def handler(request: bytes, context) -> bytes:
            self.calls.append((details.method, request))
            context.abort(REACHED, "this server received the call")
        return grpc.unary_unary_rpc_method_handler(handler)


class Server:
    """A gRPC server presenting ``cert`` (mutual TLS, the cluster CA), recording what it receives."""

    def __init__(self, ca, cert: bytes, key: bytes, address: str = "127.0.0.1:0", mutual: bool = True) -> None:
        self.recorder = Recorder()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((self.recorder,))
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca.pem, require_client_auth=mutual)
        self.port = self.server.add_secure_port(address, creds)
        assert self.port, f"cannot listen on {address}"
        self.server.start()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(0).wait(5)


def serial_of(cert_pem: bytes) -> int:
    return x509.load_pem_x509_certificate(cert_pem).serial_number


@pytest.fixture(scope="module")
def ca():
    return new_ca()


def _call(dialer: Dialer, address: str, server_name: str | None, payload: bytes) -> grpc.StatusCode:
    with dialer.sync(address, server_name=server_name) as ch, pytest.raises(grpc.RpcError) as err:
        ch.unary_unary("/kvrelay.v1.DecodeWorker/Decode")(payload, timeout=15)
    return err.value.code()


@pytest.mark.parametrize("server, client", [
    (Identity("local", CertRole.DECODE, "0"), Identity("local", CertRole.ROUTER, "router")),  # the router dials
    (Identity("local", CertRole.ROUTER, "router"), Identity("local", CertRole.DECODE, "0")),  # a worker dials
])
def test_a_revoked_server_receives_nothing_and_a_valid_one_is_reached(ca, server, client):
    stolen, current = issue(ca, server), issue(ca, server)  # the same identity: revoked, and re-issued
    cert, key = issue(ca, client)
    dialer = Dialer(TLSMaterial(ca.pem, cert, key, client, frozenset({serial_of(stolen[0])})))
    name = server.dns if server.role is CertRole.DECODE else role_dns(CertRole.ROUTER)
    with Server(ca, *stolen) as attacker:
        assert _call(dialer, f"127.0.0.1:{attacker.port}", name, b"a tenant's prompt") == grpc.StatusCode.UNAVAILABLE
        assert attacker.recorder.calls == []
    with Server(ca, *current) as real:
        assert _call(dialer, f"127.0.0.1:{real.port}", name, b"a tenant's prompt") == REACHED
        assert real.recorder.calls == [("/kvrelay.v1.DecodeWorker/Decode", b"a tenant's prompt")]


def test_the_cli_refuses_a_revoked_router(ca, tmp_path):
    ident = Identity("local", CertRole.ROUTER, "router")
    stolen = issue(ca, ident, hosts=("127.0.0.1",))
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    with Server(ca, *stolen, mutual=False) as attacker:  # as the router's public listener: tokens, no certificates
        def status(*more: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "kvrelay.cli", "status", "--router",
                                   f"127.0.0.1:{attacker.port}", "--ca", str(tmp_path / "ca.pem"), *more],
                                  capture_output=True, text=True, timeout=60,
                                  env={**os.environ, "KVRELAY_OPERATOR_TOKEN": "an operator's token",
                                       "KVRELAY_CACHE_DIR": str(tmp_path)})
        got = status("--revoked", format(serial_of(stolen[0]), "x"))
        assert got.returncode != 0 and attacker.recorder.calls == []
        assert status().returncode != 0 and len(attacker.recorder.calls) == 1  # without --revoked it is reached


def test_the_router_refuses_a_revoked_worker_that_took_over_an_address(plumbing_model):
    """A decode worker dies; on its address (still registered) a server presents a revoked
    certificate of the same identity. The router's reconnection is refused before any
    request crosses, and every request is served by the other decode worker."""
    raw = dict(CLUSTER_YAML, sites=[{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 0},
                                     "decode": {"replicas": 2}}])
    raw["router"] = dict(raw["router"], placement={"policy": "least_loaded"},
                         liveness={"heartbeat_interval_s": 0.25, "worker_timeout_s": 60.0})
    lc = LocalCluster(parse_config(raw), plumbing_model, reconcile=False)
    stolen = issue(lc.creds.ca, Identity("local", CertRole.DECODE, "0"))
    lc.cfg.tls.revoked_serials.append(format(serial_of(stolen[0]), "x"))
    lc.creds.revoked = parse_serials(lc.cfg.tls.revoked_serials)
    lc.start()
    try:
        assert wait_until(lambda: len(workers(lc)) == 2, 60)
        address = workers(lc)["local/decode/0"].info.address
        victim = next(c for c in lc.children if c.name == "local/decode/0")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        lc.children.remove(victim)
        with Server(lc.creds.ca, *stolen, address=address) as attacker:
            served = [_generate(lc, i) for i in range(6)]
            assert attacker.recorder.calls == []
        assert all(w == "local/decode/1" for w in served), served
    finally:
        lc.stop()


def _generate(lc: LocalCluster, i: int) -> str:
    with lc.channel() as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=[400 + i, 401, 402, 403]), max_tokens=2, ignore_eos=True), timeout=60))
    assert sum(len(m.token_ids) for m in msgs) == 2
    return msgs[-1].finish.placement.decode_worker

