"""Credentials that rotate under a live cluster (issue 37, item 3), on real processes over
loopback with certificates that live 20 s: the launcher renews every process's certificate
before it expires, and again from a new CA when `kvrelay pki rotate-ca` runs on the config's
CA folder, while requests stream throughout on gRPC (one long-lived channel, and a new one per
request) and HTTPS; none fails. The rotation takes its three steps (the new CA trusted, then
issuing, then the old one dropped) and the old CA's certificates are then refused; a serial
revoked in the operator's config file reaches the router and the workers, none of them
restarted."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.runtime.pki import (
    CA_CERT,
    CA_KEY,
    CertRole,
    Identity,
    finish_rotation,
    init_ca_dir,
    issue,
    issue_with_new_ca,
    load_ca,
    rotate_ca_dir,
)
from kvrelay.runtime.rpc import Dialer
from kvrelay.runtime.tls import TLSMaterial
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from tests.integration.helpers import CLUSTER_YAML, running_cluster, wait_until, workers

pytestmark = pytest.mark.model

LIFETIME_S = 20.0
"""Each certificate's life: the launcher renews it after two thirds (13 s)."""
PROMPT = "Renewal keeps every stream going while the certificates change under it."


@pytest.fixture(scope="module")
def renewing(plumbing_model, tmp_path_factory):
    """A cluster on a CA folder of the test's own, its config in a file the launcher follows."""
    tmp_path = tmp_path_factory.mktemp("renewing")
    pki = tmp_path / "pki"
    init_ca_dir(pki)
    raw = dict(CLUSTER_YAML, router=dict(CLUSTER_YAML["router"], http_port=0))
    raw["tls"] = {"ca": str(pki / CA_CERT), "ca_key": str(pki / CA_KEY), "cert_days": LIFETIME_S / 86400}
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(raw))
    with running_cluster(raw, plumbing_model, reconcile=False, config_file=config) as lc:
        lc.started_at = time.time()
        yield lc, pki, config


PAUSE_S = 0.2
"""Between two requests of a thread: without it the three threads kept both cores busy for the whole
test (35 s of CPU on two cores); with it each still sends several requests a second through every step."""


class Streams:
    """Requests on three threads, PAUSE_S apart, until stopped: gRPC streams on one channel kept
    open, gRPC streams each on a new channel (a new handshake each), HTTPS completions each on a
    new connection. Every failure is kept."""

    def __init__(self, lc) -> None:
        self.lc, self.stop = lc, threading.Event()
        self.done = {"kept": 0, "fresh": 0, "https": 0}
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in self.done]

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _generate(self, channel) -> None:
        tokens = [r for r in igrpc.InferenceStub(channel).Generate(
            ipb.GenerateRequest(prompt=PROMPT, max_tokens=24), timeout=120) if r.token_ids]
        assert tokens, "no tokens"

    def _https(self) -> None:
        ctx = ssl.create_default_context(cadata=self.lc.creds.ca_pem.decode())  # the bundle trusted now
        req = urllib.request.Request(f"https://{self.lc.http_address}/v1/completions", headers={
            "content-type": "application/json", "authorization": f"Bearer {self.lc.client_token}"},
            data=json.dumps({"prompt": PROMPT, "max_tokens": 16}).encode())
        with urllib.request.urlopen(req, timeout=120, context=ctx) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 16

    def _run(self, kind: str) -> None:
        kept = self.lc.client_dialer.sync(self.lc.router_address) if kind == "kept" else None
        try:
            while not self.stop.is_set():
                try:
                    if kind == "kept":
                        self._generate(kept)
                    elif kind == "fresh":
                        with self.lc.client_dialer.sync(self.lc.router_address) as ch:
                            self._generate(ch)
                    else:
                        self._https()
                    self.done[kind] += 1
                except Exception as exc:  # every failure is the test's finding
                    self.failures.append(f"{kind}: {exc!r}"[:400])
                self.stop.wait(PAUSE_S)
        finally:
            if kept is not None:
                kept.close()


def _served(lc, address: str | None = None) -> x509.Certificate:
    """The certificate a listener (the router's public one) presents to a new connection: a TLS 1.3
    client has it before a listener that wants a client certificate refuses it for the lack of one."""
    host, port = (address or lc.router_address).rsplit(":", 1)
    ctx = ssl.create_default_context(cadata=lc.creds.ca_pem.decode())
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw, ctx.wrap_socket(raw) as conn:
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def _scrape(address: str) -> dict[str, float]:
    """The certificate gauges a process's /metrics serves."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
    return {f.name: f.samples[0].value for f in families if f.name.startswith("kvrelay_tls_certificate")}


def _served_at(address: str, lc) -> int:
    return _served(lc, address).serial_number


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _lists_workers(lc, operator: tuple[bytes, bytes, Identity]) -> grpc.StatusCode:
    """ListWorkers on the internal listener with ``operator``'s certificate, trusting the bundle trusted now."""
    with Dialer(TLSMaterial(lc.creds.ca_pem, *operator)).sync(lc.internal_address) as ch:
        try:
            wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _operator(ca, name: str) -> tuple[bytes, bytes, Identity]:
    ident = Identity("local", CertRole.OPERATOR, name)
    return (*issue(ca, ident), ident)


def test_certificates_renew_and_the_ca_rotates_under_streaming_requests(renewing):
    lc, pki, _ = renewing
    pids = {c.name: c.proc.pid for c in lc.children}
    first = _served(lc)
    old_ca = load_ca(pki / CA_CERT, pki / CA_KEY)
    old_operator = _operator(old_ca, "old-noc")
    with Streams(lc) as streams:
        # every process renewed, the router serving its second certificate
        assert wait_until(lambda: lc.keeper.renewals >= len(pids), 4 * LIFETIME_S)
        assert wait_until(lambda: _served(lc).serial_number != first.serial_number, 10)
        renewed_before_rotation = streams.done.copy()
        new, _ = rotate_ca_dir(pki, overlap_days=1)  # step 1: the new CA trusted everywhere, the old one issues
        new_operator = _operator(new, "new-noc")
        assert wait_until(lambda: _lists_workers(lc, new_operator) == grpc.StatusCode.OK, 20)
        assert _issued_by(_served(lc), old_ca.cert)
        time.sleep(3)  # every process's folder looked at since the launcher wrote them all (each looks every 2 s)
        issue_with_new_ca(pki, force=True)  # step 2 (sooner than the CLI allows: the test knows who looked)
        listeners = [lc.router_address, *(w.info.address for w in workers(lc).values())]
        assert wait_until(lambda: all(_issued_by(_served(lc, a), new.cert) for a in listeners), 20)
        assert _lists_workers(lc, old_operator) == grpc.StatusCode.OK  # the overlap: the old CA still trusted
        finish_rotation(pki, force=True)  # step 3, before the overlap's end: only the new CA anywhere
        assert wait_until(lambda: _lists_workers(lc, old_operator) == grpc.StatusCode.UNAVAILABLE, 20)
        assert _lists_workers(lc, new_operator) == grpc.StatusCode.OK
        # requests went on past the expiry of the first certificates, and after the end of the overlap
        assert wait_until(lambda: time.time() > first.not_valid_after_utc.timestamp() + 2, 2 * LIFETIME_S)
        time.sleep(2)
    print(f"requests served: {streams.done} ({renewed_before_rotation} before the rotation); "
          f"certificates issued again: {lc.keeper.renewals}")
    assert streams.failures == [], streams.failures
    assert all(n >= 2 for n in renewed_before_rotation.values()), renewed_before_rotation
    assert all(streams.done[k] > renewed_before_rotation[k] for k in streams.done), streams.done
    assert {c.name: c.proc.pid for c in lc.children} == pids  # nothing restarted
    assert len(workers(lc)) == 2
    # /metrics of each process: its certificate's end, and the renewals it took (lifetime, 3 rotation steps)
    router = _scrape(lc.metrics_address)
    assert router["kvrelay_tls_certificate_expiry_timestamp_seconds"] == _served(lc).not_valid_after_utc.timestamp()
    for w in workers(lc).values():
        assert _scrape(w.info.metrics_address)["kvrelay_tls_certificate_renewals"] >= 4
    assert router["kvrelay_tls_certificate_renewals"] >= 4


def test_a_serial_revoked_in_the_operators_config_reaches_router_and_workers(renewing):
    """The launcher follows the config file it was given: a serial added there is refused by
    the router (an operator's certificate) and by a worker (a certificate naming the router)."""
    lc, pki, config = renewing
    ca = load_ca(pki / CA_CERT, pki / CA_KEY)
    operator = _operator(ca, "on-call")
    router_ident = Identity.parse(lc.cfg.router_uri)
    assert router_ident is not None
    cert, key = issue(ca, router_ident)
    as_router = Dialer(TLSMaterial(lc.creds.ca_pem, cert, key, router_ident))
    info = workers(lc)["local/decode/0"].info

    def worker_stats() -> grpc.StatusCode:
        with as_router.sync(info.address, server_name=Identity("local", CertRole.DECODE, "0").dns) as ch:
            try:
                wgrpc.DecodeWorkerStub(ch).Stats(wpb.StatsRequest(), timeout=10)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK
    assert _lists_workers(lc, operator) == grpc.StatusCode.OK and worker_stats() == grpc.StatusCode.OK
    pids = {c.name: c.proc.pid for c in lc.children}
    raw = yaml.safe_load(config.read_text())
    raw["tls"]["revoked_serials"] = [format(x509.load_pem_x509_certificate(p).serial_number, "x")
                                     for p in (operator[0], cert)]
    config.write_text(yaml.safe_dump(raw))
    assert wait_until(lambda: _lists_workers(lc, operator) == grpc.StatusCode.UNAUTHENTICATED, 20)
    assert wait_until(lambda: worker_stats() == grpc.StatusCode.UNAUTHENTICATED, 20)
    assert {c.name: c.proc.pid for c in lc.children} == pids
    with lc.client_dialer.sync(lc.router_address) as ch:  # the router's own certificate is not revoked
        assert any(r.token_ids for r in igrpc.InferenceStub(ch).Generate(
            ipb.GenerateRequest(prompt=PROMPT, max_tokens=4), timeout=60))
    copy = yaml.safe_load(Path(lc.config_path).read_text())
    assert sorted(copy["tls"]["revoked_serials"]) == sorted(raw["tls"]["revoked_serials"])


def test_workers_come_back_to_a_restarted_router_with_their_renewed_certificates(renewing):
    """A channel presents the certificate it was made with whenever it connects again: after
    the router restarts, workers whose first certificates expired long ago register again
    (their heartbeats' channel made again after each renewal) and serve."""
    lc, _, _ = renewing
    assert wait_until(lambda: time.time() > lc.started_at + LIFETIME_S + 2, 2 * LIFETIME_S)
    assert lc.keeper.renewals >= 1
    lc.restart_router(kill=True)
    assert wait_until(lambda: len(workers(lc)) == 2, 30)
    with lc.client_dialer.sync(lc.router_address) as ch:
        assert any(r.token_ids for r in igrpc.InferenceStub(ch).Generate(
            ipb.GenerateRequest(prompt=PROMPT, max_tokens=4), timeout=60))
