"""The OpenID verifier's own rules (router/core/oidc.py) with keys served from
memory: a discovery document naming another issuer, keys past jwks_max_age_s
while the provider is down, a key whose JWK names another algorithm, a token
whose claims match no rule. The real provider's tokens: tests/integration/test_oidc.py."""

from __future__ import annotations

import argparse
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

import kvrelay.router.core.oidc as oidc
from kvrelay.cli.common import client_token
from kvrelay.cli.login import save
from kvrelay.launch.credentials import CLIENT_TOKEN
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.oidc import OIDCVerifier
from kvrelay.runtime.config import ClaimRule, OIDCProviderSection

ISSUER = "https://idp.example.org"


def _provider(**kw) -> OIDCProviderSection:
    return OIDCProviderSection(name="idp", issuer=ISSUER, audience="urn:kvrelay",
                               rules=[ClaimRule(claim="groups", value="lab", tenant="lab")], **kw)


class Served:
    """The provider's discovery document and keys, as a fetch function; ``down`` makes it fail."""

    def __init__(self, issuer: str = ISSUER, alg: str = "RS256") -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = json.loads(RSAAlgorithm.to_jwk(self.key.public_key())) | {"kid": "k1", "use": "sig", "alg": alg}
        self.docs = {f"{ISSUER}/.well-known/openid-configuration": {"issuer": issuer, "jwks_uri": f"{ISSUER}/jwks"},
                     f"{ISSUER}/jwks": {"keys": [jwk]}}
        self.down = False

    def __call__(self, url: str, timeout_s: float, context) -> bytes:
        if self.down:
            raise OSError("connection refused")
        return json.dumps(self.docs[url]).encode()

    def token(self, **claims) -> str:
        now = int(time.time())
        body = {"iss": ISSUER, "aud": "urn:kvrelay", "sub": "alice", "iat": now, "exp": now + 600,
                "groups": ["lab"]} | claims
        return jwt.encode(body, self.key, algorithm="RS256", headers={"kid": "k1"})


def _refusal(verifier: OIDCVerifier, token: str) -> RouterError:
    with pytest.raises(RouterError) as err:
        verifier.verify(token)
    return err.value


def test_a_good_token_maps_to_its_tenant_and_is_remembered():
    served = Served()
    v = OIDCVerifier([_provider()], fetch=served)
    token = served.token()
    p = v.verify(token)
    assert (p.tenant, p.operator, p.subject) == ("lab", None, "alice")
    served.down = True
    assert v.verify(token) is p  # remembered until it expires
    v.close()


def test_a_discovery_document_naming_another_issuer_is_refused():
    served = Served(issuer="https://evil.example.org")
    v = OIDCVerifier([_provider()], fetch=served)
    err = _refusal(v, served.token())
    assert err.kind is ErrorKind.UNAUTHENTICATED
    assert "could not be fetched" in err.message and "names issuer 'https://evil.example.org'" in err.message
    v.close()


def test_keys_past_their_max_age_are_refused_while_the_provider_is_down(monkeypatch):
    served = Served()
    v = OIDCVerifier([_provider(jwks_max_age_s=60, jwks_refresh_s=30)], fetch=served)
    v.verify(served.token())
    served.down = True
    later = time.monotonic() + 120
    monkeypatch.setattr(oidc.time, "monotonic", lambda: later)
    err = _refusal(v, served.token(sub="bob"))
    assert "were last fetched 120 s ago, more than its jwks_max_age_s (60 s): connection refused" in err.message
    v.close()


def test_a_key_for_another_algorithm_and_claims_matching_no_rule():
    served = Served(alg="PS256")
    v = OIDCVerifier([_provider(algorithms=["RS256", "PS256"])], fetch=served)
    assert "is not that of provider idp's key 'k1' (PS256)" in _refusal(v, served.token()).message
    v.close()
    served = Served()
    v = OIDCVerifier([_provider()], fetch=served)
    err = _refusal(v, served.token(groups=["chemistry"]))
    assert err.kind is ErrorKind.PERMISSION_DENIED
    assert "matches none of its rules (identity.oidc[].rules: groups=lab)" in err.message
    v.close()


def test_the_cli_sends_the_local_token_to_the_local_default_and_the_openid_one_elsewhere(tmp_path, monkeypatch):
    """After `kvrelay login`, the local default (no --ca) still gets its own token; a cluster named
    with --ca gets the OpenID token; with no local token, the OpenID one goes everywhere."""
    monkeypatch.delenv("KVRELAY_API_KEY", raising=False)
    save(tmp_path, "https://idp.example", "kvrelay-cli", "https://idp.example/token", "urn:kvrelay",
         {"access_token": "openid-token", "expires_in": 3600})
    (tmp_path / CLIENT_TOKEN).write_text("local-token\n")
    local = argparse.Namespace(cache_dir=tmp_path, ca=None)
    remote = argparse.Namespace(cache_dir=tmp_path, ca=tmp_path / "their-ca.pem")
    assert (client_token(local), client_token(remote)) == ("local-token", "openid-token")
    monkeypatch.setenv("KVRELAY_API_KEY", "from-env")
    assert (client_token(local), client_token(remote)) == ("from-env", "from-env")
    monkeypatch.delenv("KVRELAY_API_KEY")
    (tmp_path / CLIENT_TOKEN).unlink()
    assert (client_token(local), client_token(remote)) == ("openid-token", "openid-token")
