"""The rules of trust that need no running cluster: plaintext and anonymous
access only on loopback, the KV secret's minimum, keyed tenant salts, who a
caller is, and which worker id a registration may claim."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.router.cluster.registry import worker_identity
from kvrelay.router.core.auth import ANONYMOUS, CallerAuth, TenantSalts, token_sha256
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.runtime.config import ConfigError, parse_config
from kvrelay.runtime.kvsecret import read_secret
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.runtime.rpc import bind, create_server
from kvrelay.v1 import worker_pb2 as wpb


@pytest.mark.parametrize("section", [{"tls": {"enabled": False}}, {"auth": {"allow_anonymous": True}}])
@pytest.mark.parametrize("where", [{"router": {"host": "0.0.0.0"}}, {"workers": {"host": "10.1.2.3"}}])
def test_plaintext_and_anonymous_are_refused_off_loopback(section, where):
    with pytest.raises(ConfigError) as err:
        parse_config(section | where)
    assert "not a loopback address" in str(err.value) and next(iter(section)) in str(err.value)
    parse_config(section)  # on loopback (the default host) they are allowed


def test_a_plaintext_listener_is_refused_off_loopback():
    async def try_bind() -> None:
        with pytest.raises(OSError, match="plaintext"):
            bind(create_server(), "0.0.0.0", 0, None)
    asyncio.run(try_bind())


def test_tls_config_fields_are_checked():
    with pytest.raises(ConfigError, match=r"tls.revoked_serials"):
        parse_config({"tls": {"revoked_serials": ["not hex!"]}})
    with pytest.raises(ConfigError, match=r"tls.key"):
        parse_config({"tls": {"cert": "/x.pem"}})
    with pytest.raises(ConfigError, match=r"tls.cert_days"):
        parse_config({"tls": {"cert_days": 0}})
    with pytest.raises(ConfigError, match="unknown field"):
        parse_config({"tls": {"verify": False}})


def test_workers_need_a_kv_secret_of_32_bytes(tmp_path):
    for short in ("", "x" * 31):
        with pytest.raises(SystemExit, match="at least 32"):
            read_secret(None, short)
    weak = tmp_path / "secret"
    weak.write_text("password\n")
    with pytest.raises(SystemExit, match="at least 32"):
        read_secret(str(weak), "")
    with pytest.raises(SystemExit, match="cannot read"):
        read_secret(str(tmp_path / "missing"), "")
    assert read_secret(None, "k" * 32) == b"k" * 32


def test_tenant_salts_are_keyed():
    a, b = TenantSalts(b"1" * 32), TenantSalts(b"2" * 32)
    assert a.of("lab-b") != "lab-b" and "lab-b" not in a.of("lab-b")
    assert a.of("lab-b") == a.of("lab-b") != a.of("lab-a")
    assert a.of("lab-b") != b.of("lab-b")  # without the key, nobody can compute (or forge) a tenant's salt


def _auth(**kw) -> CallerAuth:
    cfg = parse_config({"tenants": [{"name": "lab-a", "token_sha256": token_sha256("tok-a")}, {"name": "lab-c"}],
                        "auth": {"operators": [{"name": "noc", "token_sha256": token_sha256("tok-noc")}]} | kw})
    return CallerAuth(cfg)


def _kind(fn) -> ErrorKind:
    with pytest.raises(RouterError) as err:
        fn()
    return err.value.kind


def test_callers_are_named_by_token_or_certificate():
    auth = _auth()
    assert auth.tenant("Bearer tok-a") == "lab-a"
    assert auth.tenant("", Identity("x", CertRole.CLIENT, "lab-c")) == "lab-c"
    assert _kind(lambda: auth.tenant("")) is ErrorKind.UNAUTHENTICATED  # closed by default
    assert _kind(lambda: auth.tenant("Bearer tok-noc")) is ErrorKind.UNAUTHENTICATED
    assert _kind(lambda: auth.tenant("", Identity("x", CertRole.DECODE, "0"))) is ErrorKind.PERMISSION_DENIED
    # a certificate for a tenant the config does not list: no policy, so no service
    assert _kind(lambda: auth.tenant("", Identity("x", CertRole.CLIENT, "lab-z"))) is ErrorKind.PERMISSION_DENIED
    assert auth.operator("Bearer tok-noc") == "noc"
    assert auth.operator("", Identity("x", CertRole.OPERATOR, "ops")) == "kvrelay://x/operator/ops"
    assert _kind(lambda: auth.operator("Bearer tok-a")) is ErrorKind.UNAUTHENTICATED
    assert _kind(lambda: auth.operator("", Identity("x", CertRole.CLIENT, "lab-a"))) is ErrorKind.PERMISSION_DENIED


def test_anonymous_callers_only_when_allowed_and_only_without_a_token():
    auth = _auth(allow_anonymous=True)
    assert auth.tenant("") == ANONYMOUS
    assert auth.tenant("Bearer tok-a") == "lab-a"
    assert _kind(lambda: auth.tenant("Bearer wrong")) is ErrorKind.UNAUTHENTICATED


def test_a_registration_claims_its_own_site_and_role():
    def info(wid: str, site: str, role: int) -> wpb.WorkerInfo:
        return wpb.WorkerInfo(worker_id=wid, site=site, role=role)

    assert worker_identity(info("toronto/decode/3", "toronto", wpb.ROLE_DECODE)) == \
        Identity("toronto", CertRole.DECODE, "3")
    assert worker_identity(info("toronto/decode/3", "montreal", wpb.ROLE_DECODE)) is None
    assert worker_identity(info("toronto/decode/3", "toronto", wpb.ROLE_PREFILL)) is None
    assert worker_identity(info("toronto/router/3", "toronto", wpb.ROLE_DECODE)) is None
    assert worker_identity(info("just-a-name", "toronto", wpb.ROLE_DECODE)) is None


def test_plaintext_with_a_certificate_or_ca_is_refused_not_ignored(tmp_path, capsys):
    from kvrelay.cli.main import main

    assert main(["--cache-dir", str(tmp_path), "generate", "--plaintext", "--ca", str(tmp_path / "ca.pem"), "hi"]) == 2
    assert "--plaintext presents no certificate" in capsys.readouterr().err
