"""The OpenID verifier's own rules (router/core/oidc.py) with keys served from
memory: a discovery document naming another issuer, keys past jwks_max_age_s
while the provider is down, a key whose JWK names another algorithm, a token
whose claims match no rule. The real provider's tokens: tests/integration/test_oidc.py."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import threading
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

import kvrelay.router.core.oidc as oidc
from kvrelay.cli.common import client_token
from kvrelay.cli.login import OIDC_TOKEN, Bound, LoginError, save
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


def checked(verifier: OIDCVerifier, token: str) -> oidc.Principal:
    """As a frontend checks: the keys' fetch awaited (off the loop's thread), then the check."""
    asyncio.run(verifier.ready(token))
    return verifier.verify(token)


def _refusal(verifier: OIDCVerifier, token: str) -> RouterError:
    with pytest.raises(RouterError) as err:
        checked(verifier, token)
    return err.value


def test_a_good_token_maps_to_its_tenant_and_is_remembered():
    served = Served()
    v = OIDCVerifier([_provider()], fetch=served)
    token = served.token()
    p = checked(v, token)
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
    checked(v, served.token())
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


def test_the_cli_sends_the_local_token_to_the_local_default_and_the_openid_one_to_its_routers(tmp_path, monkeypatch):
    """After `kvrelay login`, the local default (no --ca) still gets its own token; the routers the
    login named, verified by its CA, get the OpenID token; with no local token, they still do."""
    monkeypatch.delenv("KVRELAY_API_KEY", raising=False)
    ca = tmp_path / "their-ca.pem"
    ca.write_bytes(b"their CA bundle")
    save(tmp_path, "https://idp.example", "kvrelay-cli", "https://idp.example/token", "urn:kvrelay",
         {"access_token": "openid-token", "expires_in": 3600}, Bound.of(["r1:50051", "r2:50051"], ca.read_bytes()))
    (tmp_path / CLIENT_TOKEN).write_text("local-token\n")
    local = argparse.Namespace(cache_dir=tmp_path, ca=None, router="127.0.0.1:50051")
    remote = argparse.Namespace(cache_dir=tmp_path, ca=ca, router="r2:50051,r1:50051")
    assert (client_token(local), client_token(remote)) == ("local-token", "openid-token")
    monkeypatch.setenv("KVRELAY_API_KEY", "from-env")
    assert (client_token(local), client_token(remote)) == ("from-env", "from-env")
    monkeypatch.delenv("KVRELAY_API_KEY")
    (tmp_path / CLIENT_TOKEN).unlink()
    assert client_token(remote) == "openid-token"


def test_a_cached_openid_token_is_never_sent_to_a_router_it_was_not_obtained_for(tmp_path, monkeypatch):
    """Issue 56, finding 7: the token `kvrelay login` cached went to any router named with --ca (one of
    another deployment under the shared default audience could replay it). Now a router not in the
    login's --router, or one verified by another CA, is refused before the command dials."""
    monkeypatch.delenv("KVRELAY_API_KEY", raising=False)
    ca, other_ca = tmp_path / "ca.pem", tmp_path / "other-ca.pem"
    ca.write_bytes(b"the cluster's CA")
    other_ca.write_bytes(b"another deployment's CA")
    save(tmp_path, "https://idp.example", "kvrelay-cli", "https://idp.example/token", "urn:kvrelay",
         {"access_token": "openid-token", "expires_in": 3600}, Bound.of(["r1:50051"], ca.read_bytes()))
    for router, bundle in (("evil.example:50051", ca), ("r1:50051,evil.example:50051", ca), ("r1:50051", other_ca)):
        with pytest.raises(LoginError) as err:
            client_token(argparse.Namespace(cache_dir=tmp_path, ca=bundle, router=router))
        assert "is for r1:50051 (CA sha256" in str(err.value) and "it is not sent there" in str(err.value)
    record = json.loads((tmp_path / OIDC_TOKEN).read_text())
    del record["routers"], record["ca_sha256"]  # cached by a kvrelay login before tokens were bound
    (tmp_path / OIDC_TOKEN).write_text(json.dumps(record))
    with pytest.raises(LoginError, match="is for no router \\(cached by an older kvrelay login\\)"):
        client_token(argparse.Namespace(cache_dir=tmp_path, ca=ca, router="r1:50051"))


class Hanging(Served):
    """A provider whose fetches hang (until released) once ``hang`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hang, self.release = False, threading.Event()

    def __call__(self, url: str, timeout_s: float, context) -> bytes:
        if self.hang:
            self.release.wait(30)
        return super().__call__(url, timeout_s, context)


def test_tokens_with_made_up_key_ids_never_hold_the_event_loop_while_the_provider_hangs(monkeypatch):
    """Issue 56, finding 4: each token whose key id the router does not know waited for the keys'
    fetch on the event loop (2 s each, heartbeats and every other call behind it). Now the fetch is
    awaited as a coroutine, at most MAX_WAITERS at once (the others are answered at once), and a
    token whose key is held is checked at once."""
    monkeypatch.setattr(oidc, "MIN_REFETCH_S", 0.0)  # every unknown key id may start a fetch
    monkeypatch.setattr(oidc, "MAX_WAITERS", 3)
    served = Hanging()
    v = OIDCVerifier([_provider()], fetch=served)
    checked(v, served.token())  # the first fetch is done: k1 is held
    attacker = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    claims = jwt.decode(served.token(), options={"verify_signature": False})
    forged = [jwt.encode(claims, attacker, algorithm="RS256", headers={"kid": f"made-up-{i}"}) for i in range(7)]
    served.hang = True

    async def scenario():
        loop, gaps, done = asyncio.get_running_loop(), [], asyncio.Event()

        async def ticks():
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(0.02)
                gaps.append(loop.time() - last)
                last = loop.time()

        async def attack(token: str) -> tuple[float, RouterError]:
            start = loop.time()
            await v.ready(token)
            with pytest.raises(RouterError) as err:
                v.verify(token)
            return loop.time() - start, err.value

        ticker = asyncio.create_task(ticks())
        attacks = asyncio.gather(*(attack(t) for t in forged))
        await asyncio.sleep(0.2)
        start = loop.time()
        other = served.token(sub="bob")  # another tenant's token, its key held
        await v.ready(other)
        principal, took = v.verify(other), loop.time() - start
        results = await attacks
        done.set()
        await ticker
        return max(gaps), principal, took, results

    try:
        longest_gap, principal, took, results = asyncio.run(scenario())
    finally:
        served.release.set()
        v.close()
    # the old check held the loop INLINE_WAIT_S (2 s) per token; these bounds hold on a busy host
    assert longest_gap < 1.5, f"the event loop was held {longest_gap:.2f} s"
    assert principal.subject == "bob" and took < 1.5
    assert all(err.kind is ErrorKind.UNAUTHENTICATED and "is not among provider idp's keys" in err.message
               for _, err in results)
    waited = sorted(t for t, _ in results)
    assert all(t >= oidc.INLINE_WAIT_S - 0.1 for t in waited[-3:]), waited  # MAX_WAITERS awaited the fetch
    assert all(t < 1.5 for t in waited[:4]), waited  # the others were answered at once


def test_a_discovery_document_naming_keys_over_plain_http_is_refused():
    """Issue 56, finding 7: the ``jwks_uri`` a discovery document names is held to https (http only
    on loopback) as the config's own URLs are: keys fetched over plain http could be anyone's."""
    served = Served()
    doc = served.docs[f"{ISSUER}/.well-known/openid-configuration"]
    doc["jwks_uri"] = "http://keys.example.org/jwks"
    v = OIDCVerifier([_provider()], fetch=served)
    err = _refusal(v, served.token())
    assert "names jwks_uri 'http://keys.example.org/jwks': not https" in err.message
    v.close()


def test_a_redirect_to_plain_http_is_not_followed():
    """Issue 56, finding 7: urllib followed a provider's redirect from https to http."""
    class Redirecting(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", "http://keys.example.org/jwks")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(OSError) as err:
            oidc.http_get(f"http://127.0.0.1:{server.server_address[1]}/jwks", 5, None)
    finally:
        server.shutdown()
    assert "to 'http://keys.example.org/jwks' refused: not https" in str(err.value)
