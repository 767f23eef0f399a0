"""A real OpenID Connect provider for the tests: the npm package oidc-provider
(tests/oidc/provider.mjs, installed by `make oidc`) run by Node on loopback with
keys made here, handing out real access tokens (JWT) by the client-credentials
grant, and by the device authorization grant to a user whose sign-in
:meth:`Provider.sign_in` completes as a browser would. Restarting it with new
keys rotates them; stopping it takes it down."""

from __future__ import annotations

import base64
import html
import http.cookiejar
import json
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

SCRIPT = Path(__file__).parents[1] / "oidc" / "provider.mjs"
START_S = 30.0


def rsa_jwk(kid: str) -> dict:
    """A new RSA private key as a JWK (RS256, signing)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(RSAAlgorithm.to_jwk(key))
    jwk.pop("key_ops", None)  # oidc-provider selects keys by use, not by PyJWT's key_ops
    return jwk | {"kid": kid, "use": "sig", "alg": "RS256"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Client:
    client_id: str
    groups: list[str]
    ttl_s: int = 600

    @property
    def secret(self) -> str:
        return f"secret-of-{self.client_id}-0123456789abcdef"


class Provider:
    """oidc-provider on 127.0.0.1:``port`` with ``keys`` (private JWKs, the first signs)."""

    def __init__(self, folder: Path, clients: list[Client], keys: list[dict], port: int | None = None) -> None:
        if shutil.which("node") is None or not (SCRIPT.parent / "node_modules" / "oidc-provider").is_dir():
            raise RuntimeError("the test OpenID provider is not installed: run `make oidc` (Node 20 and npm)")
        self.folder, self.clients, self.keys = folder, {c.client_id: c for c in clients}, keys
        self.port = port or free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.extra: dict = {}
        """More of the provider's config: ``users`` (name -> groups) for the device flow, ``cli_ttl_s``."""

    def start(self) -> Provider:
        cfg = {"port": self.port, "issuer": self.issuer, "jwks": {"keys": self.keys},
               "clients": [{"client_id": c.client_id, "client_secret": c.secret, "groups": c.groups,
                            "ttl_s": c.ttl_s} for c in self.clients.values()]} | self.extra
        path = self.folder / f"provider-{self.port}.json"
        path.write_text(json.dumps(cfg))
        self.proc = subprocess.Popen(["node", str(SCRIPT), str(path)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:  # ends at its exit; the provider prints READY within seconds
            seen.append(line)
            if line.startswith("READY"):
                return self
        raise RuntimeError(f"the OpenID provider did not start: {''.join(seen)[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def rotate(self, new_key: dict) -> None:
        """Restarts the provider with ``new_key`` first (it signs from now on), the old keys still listed."""
        self.stop()
        self.keys = [new_key, *self.keys]
        self.start()

    def token(self, client_id: str, resource: str | None = None) -> str:
        """A real access token of ``client_id`` (client credentials) for ``resource`` (default urn:kvrelay)."""
        c = self.clients[client_id]
        data = {"grant_type": "client_credentials", "scope": "api"} | ({"resource": resource} if resource else {})
        auth = base64.b64encode(f"{c.client_id}:{c.secret}".encode()).decode()
        req = urllib.request.Request(f"{self.issuer}/token", data=urllib.parse.urlencode(data).encode(),
                                     headers={"Authorization": f"Basic {auth}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())["access_token"]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"the provider refused a token: {exc.read()!r}") from None

    def sign_in(self, url: str, user: str) -> None:
        """What a researcher does in a browser at the device flow's link: confirm the code, sign in as
        ``user`` (the provider's development login takes any name), each form posted with its cookies."""
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        with browser.open(url, timeout=10) as resp:
            page = resp.read().decode()
        for _ in range(8):
            form = re.search(r'<form[^>]*action="([^"]*)"[^>]*>(.*?)</form>', page, re.S)
            if form is None:
                if "Success" not in page:
                    raise RuntimeError(f"the sign-in ended without success: {page[:500]}")
                return
            fields = {n: "" for n in re.findall(r'<input[^>]*name="([^"]+)"', form[2])}
            fields |= {n: html.unescape(v) for n, v in re.findall(r'<input[^>]*name="([^"]+)"[^>]*value="([^"]*)"',
                                                                  form[2])}
            fields |= {n: v for n, v in re.findall(r'<button[^>]*name="([^"]+)"[^>]*value="([^"]*)"', form[2])}
            fields |= {k: v for k, v in (("login", user), ("password", "any")) if k in fields}
            action = urllib.parse.urljoin(self.issuer + "/", html.unescape(form[1]))
            with browser.open(urllib.request.Request(action, data=urllib.parse.urlencode(fields).encode()),
                              timeout=10) as resp:
                page = resp.read().decode()
        raise RuntimeError("the sign-in did not end within 8 pages")
