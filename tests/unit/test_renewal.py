"""Credentials that rotate without a restart: a process's material renewed from its files
(runtime/renewal.py) reaches its listeners' next handshakes and its KV handshakes; the
launcher's keeper issues certificates before they expire and again from a rotated CA
(launch/renewal.py); `kvrelay pki rotate-ca` rolls a CA in with an overlap (runtime/pki.py).
Real files, real keys, a real gRPC server on loopback."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import socket
import ssl
import stat

import grpc
import pytest
from cryptography import x509
from prometheus_client import CollectorRegistry

from kvrelay.benchmarks.handshake_bench import format_handshakes, run_handshake_bench
from kvrelay.launch.credentials import ClusterCredentials
from kvrelay.launch.ray_backend import tls_folder
from kvrelay.launch.renewal import CertKeeper
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.files import write_private
from kvrelay.runtime.kvcreds import CertCredentials
from kvrelay.runtime.kvsecret import TLS_DIR_ENV
from kvrelay.runtime.metrics import CertificateCollector
from kvrelay.runtime.pki import (
    CA_CERT,
    CA_KEY,
    CertRole,
    Identity,
    PKIError,
    Rotation,
    RotationStep,
    finish_rotation,
    init_ca_dir,
    issue,
    issue_with_new_ca,
    load_ca,
    new_ca,
    rotate_ca_dir,
)
from kvrelay.runtime.renewal import Look, MaterialFiles, follow_material, renew_from, write_material
from kvrelay.runtime.tls import TLSMaterial, load_material

ROUTER = Identity("local", CertRole.ROUTER, "main")
DECODE = Identity("local", CertRole.DECODE, "0")


def _serial(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def _files(folder, ca, ident=ROUTER, days=1.0) -> MaterialFiles:
    cert, key = issue(ca, ident, days, ("127.0.0.1",))
    write_material(folder, ca.pem, cert, key)
    return MaterialFiles.in_folder(folder)


def _material(files: MaterialFiles) -> TLSMaterial:
    pems = files.load()
    return TLSMaterial(pems.ca_pem, pems.cert_pem, pems.key_pem, pems.identity)


def test_a_renewal_is_taken_only_as_a_matching_pair_of_the_same_identity_in_date(tmp_path):
    ca = new_ca()
    files = _files(tmp_path, ca)
    material = _material(files)
    assert renew_from(files, material) is Look.SAME and material.generation == 0
    cert, key = issue(ca, ROUTER)
    write_private(files.cert, cert)  # the certificate before its key: half a renewal
    assert renew_from(files, material, quiet=True) is Look.UNUSABLE and material.generation == 0
    write_private(files.key, key)
    assert renew_from(files, material) is Look.RENEWED
    assert material.cert_pem == cert and material.key_pem == key and material.generation == 1
    other, other_key = issue(ca, Identity("local", CertRole.ROUTER, "impostor"))
    write_private(files.key, other_key)
    write_private(files.cert, other)  # another identity: a process's never changes
    assert renew_from(files, material) is Look.UNUSABLE and material.cert_pem == cert
    stranger = new_ca()
    foreign, foreign_key = issue(stranger, ROUTER)
    write_private(files.key, foreign_key)
    write_private(files.cert, foreign)  # not from the CA in ca.pem
    assert renew_from(files, material) is Look.UNUSABLE and material.cert_pem == cert


def test_following_the_files_renews_once_both_are_written(tmp_path):
    ca = new_ca()
    files = _files(tmp_path, ca)
    material = _material(files)
    renewed: list[int] = []

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(follow_material(files, material, stop, lambda p: renewed.append(_serial(p.cert_pem)),
                                                   poll_s=0.05))
        cert, key = issue(ca, ROUTER)
        write_private(files.cert, cert)
        await asyncio.sleep(0.3)  # only the certificate: looked at twice, not taken
        assert renewed == []
        write_private(files.key, key)
        for _ in range(100):
            if renewed:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 2)
        assert renewed == [_serial(cert)]
    asyncio.run(run())


def _served_serial(port: int, ca_pem: bytes) -> int:
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    ctx.check_hostname = False
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as conn:
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_listener_serves_the_renewed_certificate_and_open_channels_go_on(tmp_path):
    ca = new_ca()
    files = _files(tmp_path, ca)
    material = _material(files)

    async def run() -> None:
        server = grpc.aio.server()

        async def echo(request, context):
            return request
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        port = server.add_secure_port("127.0.0.1:0", material.server_credentials(mutual=False))
        await server.start()
        opts = [("grpc.ssl_target_name_override", "router.kvrelay")]
        channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca.pem), options=opts)
        echo_call = channel.unary_unary("/t.T/Echo")
        assert await echo_call(b"before") == b"before"
        first = await asyncio.to_thread(_served_serial, port, ca.pem)
        cert, key = issue(ca, ROUTER, hosts=("127.0.0.1",))
        write_private(files.key, key)
        write_private(files.cert, cert)
        assert renew_from(files, material) is Look.RENEWED
        assert first != _serial(cert)
        assert await asyncio.to_thread(_served_serial, port, ca.pem) == _serial(cert)
        assert await echo_call(b"after") == b"after"  # the channel opened before: its connection goes on
        await channel.close()
        await server.stop(None)
    asyncio.run(run())


def test_a_kv_handshake_pins_one_pair_across_a_renewal():
    ca = new_ca()
    cert, key = issue(ca, DECODE)
    material = TLSMaterial(ca.pem, cert, key, DECODE)
    creds = CertCredentials(material, (CertRole.PREFILL,))
    pinned = creds.pinned()
    new_cert, new_key = issue(ca, DECODE)
    material.renew(TLSMaterial(ca.pem, new_cert, new_key, DECODE).pems)
    # the handshake under way signs with the key of the certificate it presented
    creds.verify_signature(pinned.certificate, b"m", pinned.sign(b"m"))
    assert x509.load_der_x509_certificate(pinned.certificate).serial_number == _serial(cert)
    assert x509.load_der_x509_certificate(creds.certificate).serial_number == _serial(new_cert)
    creds.verify_signature(creds.certificate, b"m", creds.pinned().sign(b"m"))
    with pytest.raises(ValueError, match="bad signature"):
        creds.verify_signature(creds.certificate, b"m", pinned.sign(b"m"))


def _section(folder, cert_days=1.0):
    return parse_config({"sites": [{"name": "local"}], "tls": {
        "ca": str(folder / CA_CERT), "ca_key": str(folder / CA_KEY), "cert_days": cert_days}}).tls


def test_the_keeper_renews_before_expiry_and_reissues_from_a_rotated_ca(tmp_path):
    pki = tmp_path / "pki"
    init_ca_dir(pki)
    creds = ClusterCredentials.for_config(_section(pki, cert_days=60 / 86400), tmp_path / "scratch")
    assert creds is not None
    keeper = CertKeeper(creds, tmp_path / "tls")
    env = keeper.issue("local/decode/0", DECODE)
    folder = tmp_path / "tls" / "local-decode-0"
    assert env == {TLS_DIR_ENV: str(folder)}
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(folder / n).st_mode) for n in ("ca.pem", "cert.pem", "key.pem")} == {0o600}
    first = keeper.kept["local/decode/0"]
    serial, due = first.serial, first.due
    assert 30 < due - dt.datetime.now(dt.UTC).timestamp() <= 40  # two thirds of 60 s
    assert keeper.renew_due() == []
    assert keeper.renew_due(now=due + 1) == ["local/decode/0"] and first.serial != serial
    old_ca = load_ca(pki / CA_CERT, pki / CA_KEY)
    new, _ = rotate_ca_dir(pki, overlap_days=1)
    assert keeper.renew_due() == ["local/decode/0"]  # the bundle changed: every certificate, not yet due
    files = MaterialFiles.in_folder(folder)
    pems = files.load()
    x509.load_pem_x509_certificate(pems.cert_pem).verify_directly_issued_by(old_ca.cert)  # step 1: trust only
    assert x509.load_pem_x509_certificates(pems.ca_pem) == [old_ca.cert, new.cert]
    issue_with_new_ca(pki, force=True)
    assert keeper.renew_due() == ["local/decode/0"]
    pems = files.load()
    x509.load_pem_x509_certificate(pems.cert_pem).verify_directly_issued_by(new.cert)
    assert x509.load_pem_x509_certificates(pems.ca_pem) == [old_ca.cert, new.cert]  # both through the overlap
    finish_rotation(pki, force=True)
    assert keeper.renew_due() == ["local/decode/0"]
    assert x509.load_pem_x509_certificates(files.load().ca_pem) == [new.cert]
    keeper.forget("local/decode/0")
    assert keeper.renew_due(now=due + 10_000) == []


def test_rotate_ca_trusts_then_issues_then_finishes_and_refuses_out_of_turn(tmp_path):
    init_ca_dir(tmp_path)
    old = load_ca(tmp_path / CA_CERT, tmp_path / CA_KEY)
    leaf_old = issue(old, ROUTER)
    new, rotation = rotate_ca_dir(tmp_path, overlap_days=2)
    assert Rotation.read(tmp_path) == rotation and rotation.step is RotationStep.TRUSTING
    assert rotation.old_serials == (old.cert.serial_number,) and rotation.new_serial == new.cert.serial_number
    assert load_ca(tmp_path / CA_CERT, tmp_path / CA_KEY).cert == old.cert  # the key's certificate signs
    with pytest.raises(PKIError, match="in progress"):
        rotate_ca_dir(tmp_path, overlap_days=1)
    with pytest.raises(PKIError, match="no rotation whose new CA issues"):
        finish_rotation(tmp_path, force=True)
    issuing = issue_with_new_ca(tmp_path, force=True)
    assert issuing.step is RotationStep.ISSUING and Rotation.read(tmp_path) == issuing
    assert 1.99 < (issuing.until - issuing.since).total_seconds() / 86400 < 2.01
    assert load_ca(tmp_path / CA_CERT, tmp_path / CA_KEY).cert == new.cert
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.key", "ca.pem", "rotation.json"]  # old key gone
    section = _section(tmp_path)
    section.cert, section.key = str(tmp_path / "old.pem"), str(tmp_path / "old.key")
    write_private(tmp_path / "old.pem", leaf_old[0])
    write_private(tmp_path / "old.key", leaf_old[1])
    assert load_material(section).identity == ROUTER  # the old CA's certificates are still good
    with pytest.raises(PKIError, match="no rotation waiting to issue"):
        issue_with_new_ca(tmp_path, force=True)
    with pytest.raises(PKIError, match="the overlap lasts until"):
        finish_rotation(tmp_path)
    finish_rotation(tmp_path, force=True)
    with pytest.raises(PKIError, match="not issued by"):
        load_material(section)  # now refused
    with pytest.raises(PKIError, match="no rotation whose new CA issues"):
        finish_rotation(tmp_path)
    with pytest.raises(PKIError, match="overlap must be positive"):
        rotate_ca_dir(tmp_path, overlap_days=0)


def test_the_keeper_delivers_renewals_to_a_process_on_another_node(tmp_path):
    """A Ray worker gets its first certificate in its environment; its actor takes the renewals
    (launch/ray_backend.py writes them into a folder of that node's, which the process follows)."""
    init_ca_dir(tmp_path / "pki")
    creds = ClusterCredentials.for_config(_section(tmp_path / "pki"), tmp_path / "scratch")
    assert creds is not None
    keeper = CertKeeper(creds, tmp_path / "tls")
    env = keeper.issue_remote("local/decode/0", DECODE)
    assert TLS_DIR_ENV not in env and env["KVRELAY_TLS_KEY"].startswith("-----BEGIN PRIVATE KEY")
    assert _serial(env["KVRELAY_TLS_CERT"].encode()) == keeper.kept["local/decode/0"].serial
    due = keeper.kept["local/decode/0"].due
    assert keeper.renew_due(now=due + 1) == ["local/decode/0"]  # nowhere to deliver yet: tried again soon
    assert keeper.kept["local/decode/0"].due < due + 1 + 10
    node = tmp_path / "node"
    child_env = dict(env)
    folder = tls_folder(child_env)  # what the actor does on its node
    assert folder is not None and child_env == {TLS_DIR_ENV: str(folder)}
    assert MaterialFiles.in_folder(folder).load().identity == DECODE
    delivered: list[int] = []

    def deliver(pems) -> None:
        write_material(node, pems.ca_pem, pems.cert_pem, pems.key_pem)
        delivered.append(_serial(pems.cert_pem))
    keeper.attach("local/decode/0", deliver)
    assert keeper.renew_due(now=keeper.kept["local/decode/0"].due + 1) == ["local/decode/0"]
    assert delivered == [keeper.kept["local/decode/0"].serial]
    assert _serial(MaterialFiles.in_folder(node).load().cert_pem) == delivered[0]


def test_the_handshake_bench_times_new_channels_to_all_three_servers():
    """``kvrelay bench handshakes`` on a few connections: each of its servers answered a call on every
    new channel (a failed handshake raises), and its JSON names stay as documented."""
    res = run_handshake_bench(connections=6, renew_every=2, warmup=1)
    out = res.to_dict()
    assert set(out) == {"connections", "renew_every", "static_p50_ms", "static_p90_ms", "dynamic_p50_ms",
                        "dynamic_p90_ms", "renewing_p50_ms", "renewing_p90_ms", "dynamic_overhead_pct",
                        "renewing_overhead_pct"}
    assert all(out[f"{m}_p50_ms"] > 0 for m in ("static", "dynamic", "renewing"))
    assert "while renewing" in format_handshakes(res)
    with pytest.raises(ValueError, match="at least 1"):
        run_handshake_bench(connections=0)


def test_the_certificate_collector_follows_renewals():
    """/metrics tells when a process's certificate expires and how often it was renewed, read at each scrape."""
    ca = new_ca()
    cert, key = issue(ca, DECODE, days=1.0)
    material = TLSMaterial(ca.pem, cert, key, DECODE)
    registry = CollectorRegistry()
    registry.register(CertificateCollector(material, {"worker": "local/decode/0"}))

    def read() -> tuple[float | None, float | None]:
        labels = {"worker": "local/decode/0"}
        return (registry.get_sample_value("kvrelay_tls_certificate_expiry_timestamp_seconds", labels),
                registry.get_sample_value("kvrelay_tls_certificate_renewals", labels))
    first_end = x509.load_pem_x509_certificate(cert).not_valid_after_utc.timestamp()
    assert read() == (first_end, 0.0)
    later, later_key = issue(ca, DECODE, days=2.0)
    material.renew(TLSMaterial(ca.pem, later, later_key, DECODE).pems)
    assert read() == (x509.load_pem_x509_certificate(later).not_valid_after_utc.timestamp(), 1.0)
