"""The cluster PKI (runtime/pki.py) and TLS material (runtime/tls.py), with
real certificates: identities round-trip, server roles carry the DNS names
channels pin, every unusable certificate is refused with a message naming
the problem, and a mutual-TLS gRPC server sees who called, refuses revoked
serials and certificates of another CA."""

from __future__ import annotations

import datetime as dt
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvrelay.runtime.config import TLSSection
from kvrelay.runtime.pki import (
    CA,
    CA_CERT,
    CA_KEY,
    CertRole,
    Identity,
    PKIError,
    cert_info,
    check_pair,
    identity_of,
    init_ca_dir,
    issue,
    load_ca,
    load_cert,
    new_ca,
    read_pem,
    role_dns,
)
from kvrelay.runtime.tls import PeerRefused, TLSMaterial, load_material

SITE = "montreal"
NOW = dt.datetime.now(dt.UTC)


@pytest.fixture(scope="module")
def ca() -> CA:
    return new_ca()


@pytest.fixture(scope="module")
def other_ca() -> CA:
    return new_ca()  # same subject name as ``ca``: only the signature tells them apart


def build_cert(ca: CA, identity: Identity | None, not_before: dt.datetime,
               not_after: dt.datetime) -> tuple[bytes, bytes]:
    """A leaf certificate (PEM) and key with the given dates, signed by ``ca``."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test")]))
               .issuer_name(ca.cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    if identity is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def dns_names(cert_pem: bytes) -> set[str]:
    sans = load_cert(cert_pem, "test").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(sans.get_values_for_type(x509.DNSName))


# --- identities and what certificates carry -------------------------------------------------------------------


@pytest.mark.parametrize("role", list(CertRole))
def test_issued_certificate_names_its_identity(ca: CA, role: CertRole):
    ident = Identity(SITE, role, "w1")
    cert_pem, key_pem = issue(ca, ident)
    cert = load_cert(cert_pem, "test")
    assert identity_of(cert) == ident
    info = cert_info(cert)
    assert info.identity == ident and not info.is_ca and info.hosts == ()
    assert info.serial_hex == format(cert.serial_number, "x")
    assert check_pair(cert_pem, key_pem, ca.pem, "test").identity == ident
    assert Identity.parse(ident.uri) == ident
    assert (info.not_after - info.not_before) <= dt.timedelta(days=30, minutes=5)


@pytest.mark.parametrize("role", [CertRole.ROUTER, CertRole.PREFILL, CertRole.DECODE])
def test_server_roles_carry_the_names_channels_pin(ca: CA, role: CertRole):
    ident = Identity(SITE, role, "w1")
    cert_pem, _ = issue(ca, ident)
    assert dns_names(cert_pem) == {f"w1.{role}.{SITE}.kvrelay", f"{role}.kvrelay"} == {ident.dns, role_dns(role)}
    eku = load_cert(cert_pem, "t").extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku


@pytest.mark.parametrize("role", [CertRole.OPERATOR, CertRole.CLIENT])
def test_client_roles_carry_no_dns_names(ca: CA, role: CertRole):
    cert_pem, _ = issue(ca, Identity(SITE, role, "alice"))
    assert dns_names(cert_pem) == set()
    eku = load_cert(cert_pem, "t").extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_a_ray_node_certificate_serves_tls_but_names_no_kvrelay_component(ca: CA):
    """What RAY_TLS_SERVER_CERT needs (server and client use, its node's address), and none of the
    names a kvrelay channel pins: no worker or router channel takes it for a component."""
    cert_pem, _ = issue(ca, Identity(SITE, CertRole.NODE, "toronto-1"), hosts=("10.0.0.7",))
    eku = load_cert(cert_pem, "t").extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    assert dns_names(cert_pem) == set() and cert_info(load_cert(cert_pem, "t")).hosts == ("10.0.0.7",)


def test_the_router_workers_admit_is_pinned_by_the_config():
    from kvrelay.runtime.config import ConfigError, parse_config
    from kvrelay.runtime.tls import router_identity
    sites = [{"name": "toronto"}, {"name": "montreal"}]
    assert router_identity(parse_config({"sites": sites})) == Identity("toronto", CertRole.ROUTER, "0")
    assert router_identity(parse_config({"sites": sites, "router": {"site": "montreal"}})).uri == \
        "kvrelay://montreal/router/0"  # the Helm chart's router
    custom = parse_config({"sites": sites, "tls": {"router_identity": "kvrelay://montreal/router/main"}})
    assert router_identity(custom) == Identity("montreal", CertRole.ROUTER, "main")
    with pytest.raises(ConfigError, match=re.escape("tls.router_identity: must be kvrelay://<site>/router/<name>")):
        parse_config({"sites": sites, "tls": {"router_identity": "kvrelay://montreal/decode/0"}})


def test_extra_hosts_are_dns_names_or_ip_addresses(ca: CA):
    cert_pem, _ = issue(ca, Identity(SITE, CertRole.ROUTER, "main"), hosts=("api.example.com", "10.0.0.5", "::1"))
    assert cert_info(load_cert(cert_pem, "t")).hosts == ("api.example.com", "10.0.0.5", "::1")


def test_parse_ignores_uris_that_name_no_identity():
    assert Identity.parse("https://example.com/x") is None
    assert Identity.parse("kvrelay://montreal/admin/x") is None
    assert Identity.parse("kvrelay://montreal/decode") is None


@pytest.mark.parametrize("site, name", [("Montreal", "w1"), ("", "w1"), ("mon treal", "w1"), ("a/b", "w1"),
                                        ("-x", "w1"), (SITE, ""), (SITE, "a b"), (SITE, "a/b"), (SITE, "x" * 64),
                                        (SITE, "-x"), (SITE, "a.b")])
def test_identity_rejects_bad_site_or_name(site: str, name: str):
    with pytest.raises(PKIError, match="site" if site != SITE else "name"):
        Identity(site, CertRole.DECODE, name)


def test_issue_refuses_a_non_positive_lifetime(ca: CA):
    with pytest.raises(PKIError, match="positive"):
        issue(ca, Identity(SITE, CertRole.DECODE, "1"), days=0)


def test_certificate_never_outlives_its_ca():
    short = new_ca(days=1)
    cert_pem, _ = issue(short, Identity(SITE, CertRole.DECODE, "1"), days=30)
    assert load_cert(cert_pem, "t").not_valid_after_utc == short.cert.not_valid_after_utc


# --- what check_pair refuses ------------------------------------------------------------------------------------


def test_check_pair_refuses_an_expired_certificate(ca: CA):
    cert_pem, key_pem = build_cert(ca, Identity(SITE, CertRole.DECODE, "1"),
                                   NOW - dt.timedelta(days=10), NOW - dt.timedelta(days=1))
    with pytest.raises(PKIError, match=r"old\.pem: certificate expired"):
        check_pair(cert_pem, key_pem, ca.pem, "old.pem")


def test_check_pair_refuses_a_certificate_not_yet_valid(ca: CA):
    cert_pem, key_pem = build_cert(ca, Identity(SITE, CertRole.DECODE, "1"),
                                   NOW + dt.timedelta(days=1), NOW + dt.timedelta(days=10))
    with pytest.raises(PKIError, match="not valid before"):
        check_pair(cert_pem, key_pem, ca.pem, "new.pem")


def test_check_pair_refuses_a_certificate_of_another_ca(ca: CA, other_ca: CA):
    cert_pem, key_pem = issue(other_ca, Identity(SITE, CertRole.DECODE, "1"))
    with pytest.raises(PKIError, match="not issued by the cluster CA"):
        check_pair(cert_pem, key_pem, ca.pem, "foreign.pem")


def test_check_pair_refuses_a_key_of_another_certificate(ca: CA):
    cert_pem, _ = issue(ca, Identity(SITE, CertRole.DECODE, "1"))
    _, other_key = issue(ca, Identity(SITE, CertRole.DECODE, "2"))
    with pytest.raises(PKIError, match="key does not belong"):
        check_pair(cert_pem, other_key, ca.pem, "mixed.pem")


def test_check_pair_refuses_a_certificate_without_identity(ca: CA):
    cert_pem, key_pem = build_cert(ca, None, NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=1))
    with pytest.raises(PKIError, match="names no kvrelay identity"):
        check_pair(cert_pem, key_pem, ca.pem, "anon.pem")


def test_check_pair_refuses_a_leaf_as_ca_bundle(ca: CA):
    cert_pem, key_pem = issue(ca, Identity(SITE, CertRole.DECODE, "1"))
    with pytest.raises(PKIError, match="is not a CA certificate"):
        check_pair(cert_pem, key_pem, cert_pem, "self.pem")


# --- files ------------------------------------------------------------------------------------------------------


def test_read_pem_names_a_missing_file(tmp_path: Path):
    path = tmp_path / "nope.pem"
    with pytest.raises(PKIError, match=re.escape(f"tls.cert {path}: file not found")):
        read_pem(path, "tls.cert")


def test_read_pem_refuses_a_file_that_is_not_pem(tmp_path: Path):
    path = tmp_path / "cert.der"
    path.write_bytes(b"\x30\x82\x01\x00 not pem")
    with pytest.raises(PKIError, match=re.escape(f"tls.cert {path}: not a PEM file")):
        read_pem(path, "tls.cert")


def test_load_cert_refuses_a_pem_without_certificate(ca: CA):
    _, key_pem = issue(ca, Identity(SITE, CertRole.DECODE, "1"))
    with pytest.raises(PKIError, match=r"key.pem: not a PEM certificate"):
        load_cert(key_pem, "key.pem")


def test_init_ca_dir_writes_private_files_and_refuses_to_overwrite(tmp_path: Path):
    folder = tmp_path / "pki"
    ca = init_ca_dir(folder, days=10)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in (CA_CERT, CA_KEY):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    assert sorted(p.name for p in folder.iterdir()) == sorted([CA_CERT, CA_KEY])
    loaded = load_ca(folder / CA_CERT, folder / CA_KEY)
    assert loaded.cert == ca.cert and cert_info(loaded.cert).is_ca
    before = (folder / CA_KEY).read_bytes()
    with pytest.raises(PKIError, match="exists there already"):
        init_ca_dir(folder)
    assert (folder / CA_KEY).read_bytes() == before
    (folder / CA_CERT).unlink()
    with pytest.raises(PKIError, match="exists there already"):
        init_ca_dir(folder)  # a key alone is not overwritten either


def test_load_ca_refuses_a_key_of_another_ca(tmp_path: Path):
    a, b = init_ca_dir(tmp_path / "a"), init_ca_dir(tmp_path / "b")
    assert a.cert != b.cert
    with pytest.raises(PKIError, match="key does not belong to the CA certificate"):
        load_ca(tmp_path / "a" / CA_CERT, tmp_path / "b" / CA_KEY)


def test_load_material_names_the_missing_file(tmp_path: Path):
    missing = tmp_path / "missing-ca.pem"
    with pytest.raises(PKIError, match=re.escape(f"tls.ca {missing}: file not found")):
        load_material(TLSSection(ca=str(missing)))
    with pytest.raises(PKIError, match=r"tls.ca: no CA bundle configured"):
        load_material(TLSSection(ca=None))
    init_ca_dir(tmp_path / "pki")
    ca_path = str(tmp_path / "pki" / CA_CERT)
    with pytest.raises(PKIError, match=r"tls.cert .*: file not found"):
        load_material(TLSSection(ca=ca_path, cert=str(tmp_path / "c.pem"), key=str(tmp_path / "c.key")))


def test_load_material_reads_the_files_the_config_names(tmp_path: Path):
    ca = init_ca_dir(tmp_path / "pki")
    ident = Identity(SITE, CertRole.PREFILL, "3")
    cert_pem, key_pem = issue(ca, ident)
    (tmp_path / "c.pem").write_bytes(cert_pem)
    (tmp_path / "c.key").write_bytes(key_pem)
    section = TLSSection(ca=str(tmp_path / "pki" / CA_CERT), cert=str(tmp_path / "c.pem"),
                         key=str(tmp_path / "c.key"), revoked_serials=["0a:ff", "1B"])
    mat = load_material(section)
    assert mat is not None and mat.identity == ident and mat.revoked.serials == frozenset({0xAFF, 0x1B})
    assert load_material(TLSSection(enabled=False)) is None


# --- mutual TLS over gRPC ---------------------------------------------------------------------------------------

SERVER = Identity(SITE, CertRole.DECODE, "d1")
METHOD = "/kvrelay.test.Who/Am"


class Pki:
    """The certificates the TLS tests use, and the server's port."""

    def __init__(self, ca: CA, other_ca: CA) -> None:
        self.ca = ca
        self.client = issue(ca, Identity(SITE, CertRole.DECODE, "d2"))
        self.revoked = issue(ca, Identity(SITE, CertRole.CLIENT, "mallory"))
        self.foreign = issue(other_ca, Identity(SITE, CertRole.DECODE, "d3"))
        self.port = 0


@pytest.fixture(scope="module")
def tls_server(ca: CA, other_ca: CA):
    pki = Pki(ca, other_ca)
    cert_pem, key_pem = issue(ca, SERVER)
    revoked_serial = load_cert(pki.revoked[0], "t").serial_number
    material = TLSMaterial(ca.pem, cert_pem, key_pem, SERVER, frozenset({revoked_serial}))

    def who_am_i(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            ident = material.peer(context)
        except PeerRefused as exc:
            context.abort(exc.code, exc.message)
        return (ident.uri if ident else "none").encode()

    handler = grpc.method_handlers_generic_handler("kvrelay.test.Who",
                                                   {"Am": grpc.unary_unary_rpc_method_handler(who_am_i)})
    server = grpc.server(ThreadPoolExecutor(max_workers=2), handlers=[handler])
    pki.port = server.add_secure_port("127.0.0.1:0", material.server_credentials(mutual=True))
    server.start()
    yield pki
    server.stop(None)


def call(pki: Pki, pair: tuple[bytes, bytes], pin: str = SERVER.dns) -> bytes:
    """One call to the test server presenting ``pair``, pinning the server's name ``pin``."""
    creds = TLSMaterial(pki.ca.pem, pair[0], pair[1]).channel_credentials()
    options = [("grpc.ssl_target_name_override", pin), ("grpc.use_local_subchannel_pool", 1)]
    with grpc.secure_channel(f"127.0.0.1:{pki.port}", creds, options=options) as ch:
        return ch.unary_unary(METHOD)(b"", timeout=10)


def test_server_sees_the_callers_identity(tls_server: Pki):
    assert call(tls_server, tls_server.client) == b"kvrelay://montreal/decode/d2"


def test_server_refuses_a_revoked_serial(tls_server: Pki):
    with pytest.raises(grpc.RpcError) as exc:
        call(tls_server, tls_server.revoked)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in exc.value.details() and "kvrelay://montreal/client/mallory" in exc.value.details()


def test_server_refuses_a_certificate_of_another_ca(tls_server: Pki):
    with pytest.raises(grpc.RpcError) as exc:
        call(tls_server, tls_server.foreign)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_channel_pinned_to_another_worker_refuses_the_server(tls_server: Pki):
    with pytest.raises(grpc.RpcError) as exc:
        call(tls_server, tls_server.client, pin=f"d9.decode.{SITE}.kvrelay")
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert call(tls_server, tls_server.client, pin=SERVER.dns) == b"kvrelay://montreal/decode/d2"
    assert call(tls_server, tls_server.client, pin=role_dns(CertRole.DECODE)) == b"kvrelay://montreal/decode/d2"


def test_a_router_whose_certificate_workers_would_refuse_does_not_start(ca: CA, tmp_path: Path, monkeypatch):
    """Workers admit only tls.router_identity: a router with another router certificate says so at once."""
    from kvrelay.router.main import router_tls
    from kvrelay.runtime.config import parse_config
    for key in ("KVRELAY_TLS_CA", "KVRELAY_TLS_CERT", "KVRELAY_TLS_KEY"):
        monkeypatch.delenv(key, raising=False)
    cert_pem, key_pem = issue(ca, Identity("toronto", CertRole.ROUTER, "other"))
    for name, pem in (("ca.pem", ca.pem), ("router.pem", cert_pem), ("router.key", key_pem)):
        (tmp_path / name).write_bytes(pem)
    tls = {"ca": str(tmp_path / "ca.pem"), "cert": str(tmp_path / "router.pem"), "key": str(tmp_path / "router.key")}
    with pytest.raises(SystemExit, match=re.escape("names kvrelay://toronto/router/other, but workers admit only "
                                                   "kvrelay://toronto/router/0 (tls.router_identity")):
        router_tls(parse_config({"sites": [{"name": "toronto"}], "tls": tls}))
    pinned = parse_config({"sites": [{"name": "toronto"}], "tls": tls | {"router_identity": "kvrelay://toronto/router/other"}})
    assert router_tls(pinned).identity == Identity("toronto", CertRole.ROUTER, "other")
