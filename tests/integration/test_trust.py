"""Trust between components, on real processes over loopback: every call
without the right identity is refused, and nothing changes in the router's
registry; certificates from another CA, expired or revoked ones, and
plaintext clients cannot connect, and the CLI says which; a client
certificate stands in for a token; nothing readable crosses the wire."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvrelay.router.core.auth import token_sha256
from kvrelay.runtime.pki import (
    CA_CERT,
    CA_KEY,
    CertRole,
    Identity,
    init_ca_dir,
    issue,
    load_ca,
    new_ca,
)
from kvrelay.runtime.rpc import Dialer
from kvrelay.runtime.tls import TLSMaterial
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from tests.integration.helpers import CLUSTER_YAML, running_cluster, wait_until, workers

pytestmark = pytest.mark.model

KVRELAY = [sys.executable, "-m", "kvrelay.cli"]
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A cluster CA of the test's own, with one operator certificate revoked in the config."""
    folder = tmp_path_factory.mktemp("pki")
    init_ca_dir(folder)
    ca = load_ca(folder / CA_CERT, folder / CA_KEY)
    revoked = issue(ca, Identity("local", CertRole.OPERATOR, "former-staff"))
    serial = x509.load_pem_x509_certificate(revoked[0]).serial_number
    return {"folder": folder, "ca": ca, "revoked": revoked, "serial": format(serial, "x")}


TENANT_TOKEN = "trust-tenant-token"

@pytest.fixture(scope="module")
def trust_cluster(plumbing_model, pki):
    raw = dict(CLUSTER_YAML, sites=[*CLUSTER_YAML["sites"], {"name": "other", "jurisdiction": "EU",
                                                              "prefill": {"replicas": 0},
                                                              "decode": {"replicas": 0}}])
    raw["router"] = dict(raw["router"], http_port=0)
    raw["tls"] = {"ca": str(pki["folder"] / CA_CERT), "ca_key": str(pki["folder"] / CA_KEY),
                  "revoked_serials": [pki["serial"]]}
    raw["tenants"] = [{"name": "local", "token_sha256": token_sha256(TENANT_TOKEN)}, {"name": "lab-c"}]  # lab-c: cert
    with running_cluster(raw, plumbing_model, reconcile=False) as lc:
        lc.client_token = TENANT_TOKEN
        yield lc


def as_cert(lc, pki, ident: Identity) -> Dialer:
    cert, key = issue(pki["ca"], ident)
    return Dialer(TLSMaterial(lc.creds.ca_pem, cert, key, ident))


def registry_state(lc) -> list[tuple[str, str, str]]:
    return sorted((w.info.worker_id, w.info.address, w.info.kv_endpoint) for w in workers(lc).values())


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def registry_calls(stub, info: wpb.WorkerInfo) -> dict:
    return {
        "Register": lambda: stub.Register(wpb.RegisterRequest(info=info), timeout=10),
        "Heartbeat": lambda: stub.Heartbeat(wpb.HeartbeatRequest(load=wpb.WorkerLoad(worker_id=info.worker_id)),
                                            timeout=10),
        "Deregister": lambda: stub.Deregister(wpb.DeregisterRequest(worker_id=info.worker_id), timeout=10),
        "ListWorkers": lambda: stub.ListWorkers(wpb.ListWorkersRequest(), timeout=10),
    }


def test_registry_refuses_callers_without_a_worker_certificate(trust_cluster, pki):
    before = registry_state(trust_cluster)
    real = workers(trust_cluster)["local/decode/0"].info
    impostor = wpb.WorkerInfo()
    impostor.CopyFrom(real)
    impostor.address = "127.0.0.1:1"
    # the public listener: TLS, but no client certificate can be presented there
    with trust_cluster.dialer().sync(trust_cluster.router_address) as ch:
        for name, call in registry_calls(wgrpc.RegistryStub(ch), impostor).items():
            assert code_of(call) in REFUSED, name
    # the internal listener without a certificate, or with one from another CA: no connection at all
    other_ca = new_ca()
    stranger = issue(other_ca, Identity("local", CertRole.DECODE, "0"))
    for dialer in (trust_cluster.dialer(), Dialer(TLSMaterial(trust_cluster.creds.ca_pem, *stranger))):
        with dialer.sync(trust_cluster.internal_address) as ch:
            for name, call in registry_calls(wgrpc.RegistryStub(ch), impostor).items():
                assert code_of(call) == grpc.StatusCode.UNAVAILABLE, name
    # an operator may list workers, but not be one
    with as_cert(trust_cluster, pki, Identity("local", CertRole.OPERATOR, "noc")) \
            .sync(trust_cluster.internal_address) as ch:
        stub = wgrpc.RegistryStub(ch)
        assert len(stub.ListWorkers(wpb.ListWorkersRequest(), timeout=10).workers) == 2
        for name in ("Register", "Heartbeat", "Deregister"):
            assert code_of(registry_calls(stub, impostor)[name]) in REFUSED, name
    assert registry_state(trust_cluster) == before


def _register(lc, pki, cert_ident: Identity, info: wpb.WorkerInfo) -> grpc.RpcError:
    with as_cert(lc, pki, cert_ident).sync(lc.internal_address) as ch, pytest.raises(grpc.RpcError) as err:
        wgrpc.RegistryStub(ch).Register(wpb.RegisterRequest(info=info), timeout=10)
    return err.value


def test_a_certificate_registers_only_its_own_site_role_and_live_id(trust_cluster, pki):
    before = registry_state(trust_cluster)
    real = workers(trust_cluster)["local/prefill/0"].info

    def claim(worker_id: str, site: str, role: int) -> wpb.WorkerInfo:
        info = wpb.WorkerInfo()
        info.CopyFrom(real)
        info.worker_id, info.site, info.role, info.address = worker_id, site, role, "127.0.0.1:1"
        return info

    prefill9 = Identity("local", CertRole.PREFILL, "9")
    err = _register(trust_cluster, pki, prefill9, claim("local/decode/9", "local", wpb.ROLE_DECODE))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "local/prefill/9" in err.details()
    err = _register(trust_cluster, pki, prefill9, claim("other/prefill/9", "other", wpb.ROLE_PREFILL))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    err = _register(trust_cluster, pki, Identity("other", CertRole.PREFILL, "0"),
                    claim("local/prefill/0", "local", wpb.ROLE_PREFILL))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    # even a valid certificate for the live worker's own id cannot take its place
    err = _register(trust_cluster, pki, Identity("local", CertRole.PREFILL, "0"),
                    claim("local/prefill/0", "local", wpb.ROLE_PREFILL))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "alive" in err.details()
    assert registry_state(trust_cluster) == before


@pytest.mark.parametrize("role", [CertRole.DECODE, CertRole.NODE])
def test_worker_and_ray_node_certificates_cannot_call_the_admin_api(trust_cluster, pki, role):
    with as_cert(trust_cluster, pki, Identity("local", role, "0")).sync(trust_cluster.internal_address) as ch:
        for call in (lambda: agrpc.AdminStub(ch).ListPools(apb.ListPoolsRequest(), timeout=10),
                     lambda: agrpc.AdminStub(ch).Scale(apb.ScaleRequest(site="local", role="decode", replicas=0),
                                                       timeout=10),
                     lambda: wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10),
                     lambda: list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(prompt="hi", max_tokens=1),
                                                                   timeout=10))):
            assert code_of(call) in REFUSED
    with trust_cluster.channel(operator=True) as ch:  # nothing was scaled
        pools = agrpc.AdminStub(ch).ListPools(apb.ListPoolsRequest(), timeout=10).pools
    assert {(p.site, p.role): p.desired for p in pools}[("local", "decode")] == 1


def test_workers_admit_only_the_router(trust_cluster, pki):
    infos = workers(trust_cluster)
    decode, prefill = infos["local/decode/0"].info, infos["local/prefill/0"].info
    work = wpb.WorkRequest(request_id="x", prompt_token_ids=[300, 301, 302], salt="lab-b")
    calls = {
        "Decode": lambda ch: list(wgrpc.DecodeWorkerStub(ch).Decode(wpb.DecodeRequest(request=work, colocated=True),
                                                                    timeout=10)),
        "Stats": lambda ch: wgrpc.DecodeWorkerStub(ch).Stats(wpb.StatsRequest(), timeout=10),
    }
    pcalls = {
        "Prefill": lambda ch: wgrpc.PrefillWorkerStub(ch).Prefill(wpb.PrefillRequest(request=work), timeout=10),
        "Stats": lambda ch: wgrpc.PrefillWorkerStub(ch).Stats(wpb.StatsRequest(), timeout=10),
    }
    operator = as_cert(trust_cluster, pki, Identity("local", CertRole.OPERATOR, "noc"))
    peer_worker = as_cert(trust_cluster, pki, Identity("local", CertRole.PREFILL, "0"))
    # a Ray node's key (README: Two Ray nodes), and a router certificate of the CA that is not this deployment's
    # router (tls.router_identity): neither calls a worker directly, past tenants, quotas and residency
    ray_node = as_cert(trust_cluster, pki, Identity("local", CertRole.NODE, "toronto-1"))
    another_router = as_cert(trust_cluster, pki, Identity("local", CertRole.ROUTER, "launcher"))
    for info, table in ((decode, calls), (prefill, pcalls)):
        site, role, name = info.worker_id.split("/")
        pin = Identity(site, CertRole(role), name).dns
        with trust_cluster.dialer().sync(info.address, server_name=pin) as ch:  # no certificate: no connection
            for what, call in table.items():
                assert code_of(lambda: call(ch)) == grpc.StatusCode.UNAVAILABLE, what  # noqa: B023 (called before the loop moves on)
        for dialer in (operator, peer_worker, ray_node, another_router):
            with dialer.sync(info.address, server_name=pin) as ch:
                for what, call in table.items():
                    assert code_of(lambda: call(ch)) == grpc.StatusCode.PERMISSION_DENIED, what  # noqa: B023 (called before the loop moves on)
        with trust_cluster.router_dialer().sync(info.address, server_name=pin) as ch:
            assert table["Stats"](ch).worker_id == info.worker_id


def _cli(*args, cache_dir, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")} | (env_extra or {})
    return subprocess.run([*KVRELAY, "--cache-dir", str(cache_dir), *args], capture_output=True, text=True,
                          timeout=120, env=env)


def _expired(ca, ident: Identity) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([])).issuer_name(ca.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=10)).not_valid_after(now - dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(ident.uri)]), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def test_bad_clients_cannot_connect_and_are_told_why(trust_cluster, pki, tmp_path):
    token = {"KVRELAY_API_KEY": trust_cluster.client_token}
    ca = ["--ca", str(trust_cluster.ca_file)]
    ok = _cli("generate", "--router", trust_cluster.router_address, *ca, "--max-tokens", "2", "hi", cache_dir=tmp_path,
              env_extra=token)
    assert ok.returncode == 0, ok.stderr
    plain = _cli("generate", "--router", trust_cluster.router_address, "--plaintext", "hi", cache_dir=tmp_path,
                 env_extra=token)
    assert plain.returncode == 1 and "TLS handshake" in plain.stderr, plain.stderr
    (tmp_path / "other-ca.pem").write_bytes(new_ca().pem)
    wrong = _cli("generate", "--router", trust_cluster.router_address, "--ca", str(tmp_path / "other-ca.pem"), "hi",
                 cache_dir=tmp_path, env_extra=token)
    assert wrong.returncode == 1 and "not from the CA given" in wrong.stderr, wrong.stderr
    no_ca = _cli("generate", "--router", trust_cluster.router_address, "hi", cache_dir=tmp_path,
                 env_extra=token)
    assert no_ca.returncode == 2 and "CA bundle" in no_ca.stderr and "not found" in no_ca.stderr
    ident = Identity("local", CertRole.OPERATOR, "noc")
    for name, (cert, key) in (("expired", _expired(pki["ca"], ident)), ("revoked", pki["revoked"])):
        (tmp_path / f"{name}.pem").write_bytes(cert)
        (tmp_path / f"{name}.key").write_bytes(key)
        got = _cli("status", "--router", trust_cluster.internal_address, *ca, "--cert", str(tmp_path / f"{name}.pem"),
                   "--key", str(tmp_path / f"{name}.key"), cache_dir=tmp_path)
        assert got.returncode != 0 and name in got.stderr, (name, got.stderr)
    # the expired certificate, presented by a client that does not check it first: the router refuses it
    expired = Dialer(TLSMaterial(trust_cluster.creds.ca_pem, *_expired(pki["ca"], ident)))
    with expired.sync(trust_cluster.internal_address) as ch:
        assert code_of(lambda: wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)) == \
            grpc.StatusCode.UNAVAILABLE


def test_a_grpc_client_without_the_ca_cannot_connect(trust_cluster):
    creds = grpc.composite_channel_credentials(grpc.ssl_channel_credentials(),
                                               grpc.access_token_call_credentials(trust_cluster.client_token))
    with grpc.secure_channel(trust_cluster.router_address, creds) as ch:
        assert code_of(lambda: igrpc.InferenceStub(ch).ListModels(ipb.ListModelsRequest(), timeout=10)) == \
            grpc.StatusCode.UNAVAILABLE


def test_client_certificates_name_tenants_and_no_credentials_is_refused(trust_cluster, pki):
    req = ipb.GenerateRequest(prompt="Say hi.", max_tokens=3)
    with trust_cluster.dialer().sync(trust_cluster.router_address) as ch:
        assert code_of(lambda: list(igrpc.InferenceStub(ch).Generate(req, timeout=30))) == \
            grpc.StatusCode.UNAUTHENTICATED
    with as_cert(trust_cluster, pki, Identity("local", CertRole.CLIENT, "lab-c")) \
            .sync(trust_cluster.internal_address) as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=60))
    assert msgs[-1].finish.usage.completion_tokens == 3
    with as_cert(trust_cluster, pki, Identity("local", CertRole.DECODE, "0")) \
            .sync(trust_cluster.internal_address) as ch:
        assert code_of(lambda: list(igrpc.InferenceStub(ch).Generate(req, timeout=30))) == \
            grpc.StatusCode.PERMISSION_DENIED


def _https(lc, tmp_path, cert_key: tuple[bytes, bytes] | None) -> tuple[int, dict]:
    """POST /v1/completions over HTTPS presenting ``cert_key`` (no token): status and body."""
    ctx = ssl.create_default_context(cafile=str(lc.ca_file))
    if cert_key is not None:
        (tmp_path / "c.pem").write_bytes(cert_key[0])
        (tmp_path / "c.key").write_bytes(cert_key[1])
        ctx.load_cert_chain(tmp_path / "c.pem", tmp_path / "c.key")
    req = urllib.request.Request(f"https://{lc.http_address}/v1/completions", headers={
        "content-type": "application/json"}, data=json.dumps({"prompt": "Say hi.", "max_tokens": 2}).encode())
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_https_takes_a_client_certificate_and_refuses_a_revoked_or_foreign_one(trust_cluster, pki, tmp_path):
    status, body = _https(trust_cluster, tmp_path, issue(pki["ca"], Identity("local", CertRole.CLIENT, "lab-c")))
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    status, body = _https(trust_cluster, tmp_path, pki["revoked"])  # a revoked serial of the config
    assert status == 401 and f"certificate serial {pki['serial']}" in body["error"]["message"], body
    assert "is revoked" in body["error"]["message"]
    other = tmp_path / "other"
    init_ca_dir(other)
    foreign = issue(load_ca(other / CA_CERT, other / CA_KEY), Identity("local", CertRole.CLIENT, "lab-c"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        _https(trust_cluster, tmp_path, foreign)  # another CA's: the handshake itself fails
    assert _https(trust_cluster, tmp_path, None)[0] == 401


class LoopbackTap:
    """Every byte on the loopback interface while it runs (AF_PACKET; root only)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.frames: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.frames.append(self.sock.recv(1 << 16))
            except TimeoutError:
                continue

    def __enter__(self) -> LoopbackTap:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()

    @property
    def data(self) -> bytes:
        return b"".join(self.frames)


@pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root")
def test_a_packet_capture_shows_no_prompt_output_or_token(trust_cluster):
    prompt = "Spell the name Quixotlantis-Marvelwood backwards, then explain it."
    with LoopbackTap() as tap:
        with socket.create_connection(("127.0.0.1", int(trust_cluster.router_address.rpartition(":")[2]))) as s:
            s.sendall(b"PLAINTEXT-CONTROL-7731")  # the tap sees cleartext when there is some
        time.sleep(0.2)
        with trust_cluster.channel() as ch:
            msgs = list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(prompt=prompt, max_tokens=24),
                                                         timeout=120))
        time.sleep(0.5)
    output = "".join(m.text for m in msgs)
    assert len(output) > 10
    assert b"PLAINTEXT-CONTROL-7731" in tap.data
    assert b"Quixotlantis" not in tap.data
    assert trust_cluster.client_token.encode() not in tap.data
    for word in {w for w in output.split() if len(w) >= 6}:
        assert word.encode() not in tap.data, word


def test_a_serial_revoked_in_the_config_file_is_refused_without_a_restart(trust_cluster, pki):
    """The router follows its config file: an operator certificate that works is refused once its
    serial is added to tls.revoked_serials there, the router never restarted (the change audited)."""
    ident = Identity("local", CertRole.OPERATOR, "on-call")
    cert, key = issue(pki["ca"], ident)
    dial = Dialer(TLSMaterial(trust_cluster.creds.ca_pem, cert, key, ident))

    def listing() -> grpc.StatusCode:
        with dial.sync(trust_cluster.internal_address) as ch:
            try:
                wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK
    assert listing() == grpc.StatusCode.OK
    router_pid = next(c.proc.pid for c in trust_cluster.children if c.name.startswith("router"))
    serial = format(x509.load_pem_x509_certificate(cert).serial_number, "x")
    raw = yaml.safe_load(trust_cluster.config_path.read_text())
    raw["tls"]["revoked_serials"] = [*raw["tls"]["revoked_serials"], serial]
    trust_cluster.config_path.write_text(yaml.safe_dump(raw))
    assert wait_until(lambda: listing() == grpc.StatusCode.UNAUTHENTICATED, 20)
    assert next(c.proc.pid for c in trust_cluster.children if c.name.startswith("router")) == router_pid
    log = Path(trust_cluster.cfg.router.records.audit_log)
    assert wait_until(lambda: any(r.get("action") == "revoked serials" and r["added"] == [serial]
                                  for r in map(json.loads, log.read_text().splitlines())), 10)
