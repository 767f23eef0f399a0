"""`kvrelay login` / `kvrelay logout`: an OpenID provider's access token by the
device authorization grant (RFC 8628): the command shows a link and a code, the
researcher signs in at their institution in any browser, and the token (with its
refresh token) is cached in ``<cache dir>/oidc-token.json`` (0600), bound to the
issuer and to the routers it was obtained for (``--router``, and the SHA-256 of
the CA bundle that vouches for them, ``--ca``). Client commands then send it
(:func:`cached_token`) to those routers only, verified by that CA (the local
default keeps its own token: cli/common.py ``client_token``), refreshing it when
it is about to expire, so nobody types anything after the first time; a command
naming any other router is refused before it dials, so a token is never handed
to a router (another deployment's, under a shared audience) that could replay it."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvrelay.runtime.files import write_private

OIDC_TOKEN = "oidc-token.json"
"""The cached token's file in the cache folder."""
REFRESH_MARGIN_S = 30.0
"""A cached token this close to its expiry is refreshed before use."""
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
TIMEOUT_S = 10.0
"""Deadline of one call to the provider."""


class LoginError(ValueError):
    """The provider refused, or answered what is not OAuth: the message says which and why."""


def _call(url: str, form: dict | None = None) -> dict:
    """GET (or POST ``form``) ``url``: its JSON object; LoginError naming an OAuth error or anything else."""
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    req = urllib.request.Request(url, data=data, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            body = resp.read(1 << 20)
    except urllib.error.HTTPError as exc:
        body = exc.read(1 << 20)
    except OSError as exc:
        raise LoginError(f"{url}: {exc}") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise LoginError(f"{url} did not answer JSON") from None
    if not isinstance(doc, dict):
        raise LoginError(f"{url} did not answer a JSON object")
    return doc


def discover(issuer: str) -> dict:
    """The provider's discovery document, its issuer checked."""
    doc = _call(issuer.rstrip("/") + "/.well-known/openid-configuration")
    if doc.get("issuer") != issuer:
        raise LoginError(f"{issuer}: its discovery document names issuer {doc.get('issuer')!r}")
    for key in ("token_endpoint", "device_authorization_endpoint"):
        if not isinstance(doc.get(key), str):
            raise LoginError(f"{issuer} has no {key}: it does not offer the device authorization grant")
    return doc


def poll(token_endpoint: str, client_id: str, start: dict, sleep=time.sleep) -> dict:
    """The token, polling as RFC 8628 says (``interval``, ``slow_down``) until ``expires_in``."""
    interval = float(start.get("interval", 5))
    deadline = time.monotonic() + float(start.get("expires_in", 600))
    while time.monotonic() < deadline:
        sleep(interval)
        doc = _call(token_endpoint, {"grant_type": DEVICE_GRANT, "device_code": start["device_code"],
                                     "client_id": client_id})
        error = doc.get("error")
        if error is None and isinstance(doc.get("access_token"), str):
            return doc
        if error == "slow_down":
            interval += 5
        elif error != "authorization_pending":
            raise LoginError(f"the provider refused the sign-in: {error}: {doc.get('error_description', '')}")
    raise LoginError("the code expired before the sign-in was completed: run kvrelay login again")


@dataclass(slots=True, frozen=True)
class Bound:
    """Where a cached token may be sent: these routers, verified by the CA bundle of this digest."""

    routers: tuple[str, ...]
    ca_sha256: str | None
    """SHA-256 (hex) of the CA bundle the routers' certificates come from; None: plaintext."""

    @classmethod
    def of(cls, routers: list[str], ca_pem: bytes | None) -> Bound:
        return cls(tuple(sorted(set(routers))), hashlib.sha256(ca_pem).hexdigest() if ca_pem is not None else None)

    def covers(self, other: Bound) -> bool:
        """Every router of ``other``, verified by the same CA, is one of these."""
        return self.ca_sha256 == other.ca_sha256 and set(other.routers) <= set(self.routers)

    def shown(self) -> str:
        ca = f"CA sha256 {self.ca_sha256[:16]}" if self.ca_sha256 else "no CA (plaintext)"
        return f"{', '.join(self.routers) or 'no router'} ({ca})"


def save(cache_dir: Path, issuer: str, client_id: str, token_endpoint: str, resource: str, doc: dict,
         bound: Bound) -> dict:
    """Writes the token (and what refreshes it), bound to ``bound``, to the cache file (0600); the record."""
    record = {"issuer": issuer, "client_id": client_id, "token_endpoint": token_endpoint, "resource": resource,
              "access_token": doc["access_token"], "refresh_token": doc.get("refresh_token"),
              "expires_at": time.time() + float(doc.get("expires_in", 300)),
              "routers": list(bound.routers), "ca_sha256": bound.ca_sha256}
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(cache_dir / OIDC_TOKEN, json.dumps(record).encode())
    return record


def cached_token(cache_dir: Path, to: Bound) -> str | None:
    """The cached access token for the routers of ``to`` (refreshed first when it is about to
    expire); None when there is no cache; LoginError when it was obtained for other routers (or
    another CA), or expired and cannot be refreshed."""
    path = cache_dir / OIDC_TOKEN
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        bound = Bound(tuple(record["routers"]), record["ca_sha256"]) if "routers" in record else None
        fresh = record["expires_at"] - time.time() > REFRESH_MARGIN_S
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoginError(f"{path} cannot be read ({exc}): run kvrelay login again") from None
    if bound is None or not bound.covers(to):
        was = bound.shown() if bound is not None else "no router (cached by an older kvrelay login)"
        raise LoginError(f"the token kvrelay login cached ({record.get('issuer')}) is for {was}; this command "
                         f"names {to.shown()}: it is not sent there. Run kvrelay login --issuer ... --router ... "
                         "--ca ... for those routers, or give a token in KVRELAY_API_KEY")
    if fresh:
        return str(record["access_token"])
    if not record.get("refresh_token"):
        raise LoginError(f"the token of {record['issuer']} expired and has no refresh token: run kvrelay login")
    doc = _call(record["token_endpoint"], {"grant_type": "refresh_token", "refresh_token": record["refresh_token"],
                                           "client_id": record["client_id"], "resource": record["resource"]})
    if "access_token" not in doc:
        raise LoginError(f"the token of {record['issuer']} could not be refreshed ({doc.get('error')}: "
                         f"{doc.get('error_description', '')}): run kvrelay login again")
    doc.setdefault("refresh_token", record["refresh_token"])
    return save(cache_dir, record["issuer"], record["client_id"], record["token_endpoint"], record["resource"],
                doc, bound)["access_token"]


def cmd_login(args: argparse.Namespace) -> int:
    """Signs in by the device authorization grant and caches the token, bound to ``--router`` and ``--ca``."""
    routers = [a.strip() for a in args.router.split(",") if a.strip()]
    if not routers:
        raise LoginError("--router: give the routers (host:port, comma-separated) the token is for")
    try:
        bound = Bound.of(routers, args.ca.read_bytes())
    except OSError as exc:
        raise LoginError(f"--ca {args.ca}: {exc.strerror or exc}") from None
    provider = discover(args.issuer)
    start = _call(provider["device_authorization_endpoint"],
                  {"client_id": args.client_id, "scope": args.scope, "resource": args.audience})
    if "device_code" not in start or "user_code" not in start:
        raise LoginError(f"the provider did not start a sign-in: {start.get('error')}: "
                         f"{start.get('error_description', '')}")
    where = start.get("verification_uri_complete") or start.get("verification_uri")
    print(f"To sign in, open {where} and enter the code {start['user_code']}", flush=True)
    doc = poll(provider["token_endpoint"], args.client_id, start)
    record = save(args.cache_dir, args.issuer, args.client_id, provider["token_endpoint"], args.audience, doc,
                  bound)
    print(f"signed in at {args.issuer}; the token is cached in {args.cache_dir / OIDC_TOKEN} for {bound.shown()} "
          f"(refreshed {'automatically' if record['refresh_token'] else 'never: sign in again when it expires'})")
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    path = args.cache_dir / OIDC_TOKEN
    path.unlink(missing_ok=True)
    print(f"removed {path}", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    lg = sub.add_parser("login", help="sign in at an OpenID provider (device authorization grant); client "
                                      "commands then send its token")
    lg.add_argument("--issuer", required=True, help="the provider (the router's identity.oidc issuer)")
    lg.add_argument("--router", required=True, help="the routers the token is for (host:port, comma-separated): "
                                                    "client commands send it to those alone")
    lg.add_argument("--ca", type=Path, required=True, help="the CA bundle those routers' certificates come from "
                                                           "(the token goes only to routers it verifies)")
    lg.add_argument("--client-id", default="kvrelay-cli", help="this command's client at the provider "
                                                               "(default: %(default)s)")
    lg.add_argument("--audience", default="urn:kvrelay", help="the resource the token is for (the router's "
                                                              "identity.oidc audience; default: %(default)s)")
    lg.add_argument("--scope", default="openid offline_access api", help="scopes asked (offline_access: a "
                                                                         "refresh token; default: %(default)s)")
    lg.set_defaults(func=cmd_login)
    lo = sub.add_parser("logout", help="forget the cached OpenID token")
    lo.set_defaults(func=cmd_logout)
