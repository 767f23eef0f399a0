"""OpenID Connect access tokens (JWT) as bearer credentials: the checks a careful
resource server makes, then the config's claim rules (``identity.oidc``).

A token is checked in this order, and refused (UNAUTHENTICATED, the reason named)
at the first that fails:

1. it is a JWT (three base64url parts), its header's ``alg`` one the provider
   accepts (``none`` and HS* never are: runtime/config.py);
2. its ``iss`` is a configured provider's issuer, exactly;
3. its ``kid`` is among that provider's keys, fetched from its ``jwks_uri`` (or
   the one its discovery document names) every ``jwks_refresh_s`` by a thread of
   its own, and at once (at most every :data:`MIN_REFETCH_S`) for a ``kid`` not
   yet known: a rotated key is picked up without a restart. That fetch is awaited
   (:meth:`OIDCVerifier.ready`, :data:`INLINE_WAIT_S` at most, :data:`MAX_WAITERS`
   at once) as a coroutine, never on the event loop's thread: a slow or hanging
   provider delays only the tokens that need its new keys. A provider that
   cannot be reached leaves the keys already fetched in use until
   ``jwks_max_age_s`` after the last fetch that succeeded;
4. the signature verifies against that key (a key whose own ``alg`` differs
   from the header's is not used);
5. ``aud`` holds the provider's ``audience``; ``exp`` and ``nbf`` hold with
   ``clock_skew_s`` of leeway; ``exp``, ``iat``, ``sub`` are present.

Then the provider's rules, in order: the first whose claim holds its value
makes the token a tenant's or an operator's; none is PERMISSION_DENIED. A
verified token is remembered (by its SHA-256) until it expires, so a stream of
requests with one token verifies it once."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import jwt

from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.runtime.config import ClaimRule, OIDCProviderSection, oidc_url_allowed

log = logging.getLogger(__name__)

MIN_REFETCH_S = 2.0
"""Least seconds between two fetches of a provider's keys for an unknown ``kid``."""
MAX_DOCUMENT_BYTES = 1 << 20
"""A discovery document or key set larger than this is refused."""
INLINE_WAIT_S = 2.0
"""Longest a call awaits the keys' thread fetching a key id it does not know (a provider slower than
this makes that token fail; a busy 2-core host can take most of a second for a fetch on loopback)."""
MAX_WAITERS = 64
"""Most calls awaiting one provider's fetch at once; the others are checked at once against the keys
held (an unknown key id refused): what a flood of tokens with made-up key ids can hold is bounded."""
RETRY_S = 10.0
"""Seconds between two fetches of a provider's keys while it cannot be reached."""
MAX_REMEMBERED = 10_000
"""Most verified tokens remembered at once."""

Fetch = Callable[[str, float, ssl.SSLContext | None], bytes]


class _HttpsRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL the provider's own may be (https; http on loopback)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not oidc_url_allowed(newurl):
            raise urllib.error.HTTPError(newurl, code, f"redirect from {req.full_url} to {newurl[:200]!r} refused: "
                                         "not https", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def http_get(url: str, timeout_s: float, context: ssl.SSLContext | None) -> bytes:
    """The body of a GET of ``url``; OSError (or ValueError for an oversized one) otherwise."""
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), _HttpsRedirects())
    with opener.open(req, timeout=timeout_s) as resp:
        body = resp.read(MAX_DOCUMENT_BYTES + 1)
    if len(body) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"{url}: larger than {MAX_DOCUMENT_BYTES} bytes")
    return body


@dataclass(slots=True, frozen=True)
class Principal:
    """Who a verified token is: a tenant's or an operator's, and its subject at its issuer."""

    subject: str
    issuer: str
    provider: str
    tenant: str | None
    operator: str | None
    expires: float

    @property
    def credential(self) -> str:
        """How audit records name it."""
        return f"oidc {self.provider} sub={self.subject} iss={self.issuer}"


def _refused(why: str) -> RouterError:
    return RouterError(ErrorKind.UNAUTHENTICATED, f"OpenID token refused: {why}")


class KeySet:
    """One provider's signing keys (by ``kid``: the key and the ``alg`` its JWK names, if any), kept
    fresh by a daemon thread that fetches them at once, then every ``jwks_refresh_s`` (after a
    failure, every :data:`RETRY_S`)."""

    def __init__(self, provider: OIDCProviderSection, fetch: Fetch = http_get) -> None:
        self.provider, self._fetch = provider, fetch
        self._context = ssl.create_default_context(cafile=provider.ca) if provider.ca else None
        self._keys: dict[str, tuple[jwt.PyJWK, str | None]] = {}
        self._fetched_at: float | None = None
        self._tried_at = float("-inf")
        self._error: str | None = None
        self._jwks_uri = provider.jwks_uri
        self._lock = threading.Lock()
        """Guards the keys and the times and error of the fetches."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set to make the thread fetch now (a key id not yet known, keys past their age)."""
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        """The calls awaiting the fetch under way (:meth:`fetched`), woken when it ends."""
        self._in_flight = True  # the thread's first fetch, at once
        self._thread = threading.Thread(target=self._run, name=f"oidc-keys-{provider.name}", daemon=True)
        self._thread.start()

    def key(self, kid: str) -> tuple[jwt.PyJWK, str | None]:
        """The key ``kid`` and the algorithm its JWK names; RouterError(UNAUTHENTICATED) naming
        why there is none. Never waits: a ``kid`` not yet known, or keys past ``jwks_max_age_s``,
        make the thread fetch the keys (at most every :data:`MIN_REFETCH_S`), and the answer is
        what is held now (:meth:`fetched` awaits that fetch first)."""
        with self._lock:
            start = self._due(kid)[1]
            key, fetched, error, in_flight = self._keys.get(kid), self._fetched_at, self._error, self._in_flight
        if start:
            self._wake.set()
        name = self.provider.name
        if fetched is None:
            raise _refused(f"the keys of provider {name} could not be fetched yet: "
                           f"{error or 'its first fetch is under way'}")
        age = time.monotonic() - fetched
        if age > self.provider.jwks_max_age_s:
            raise _refused(f"the keys of provider {name} were last fetched {age:.0f} s ago, more than its "
                           f"jwks_max_age_s ({self.provider.jwks_max_age_s:g} s): {error}")
        if key is None:
            down = f"; the provider cannot be reached: {error}" if error else ""
            again = "; its keys are being fetched again: retry in a moment" if in_flight else ""
            raise _refused(f"its key id {kid[:100]!r} is not among provider {name}'s keys (fetched {age:.0f} s "
                           f"ago){down}{again}")
        return key

    async def fetched(self, kid: str, timeout_s: float = INLINE_WAIT_S) -> None:
        """Returns once the keys could answer for ``kid``: at once when they hold it (fresh) or no
        fetch can be made yet, else when the fetch this starts or joins ends, or after ``timeout_s``,
        or at once when :data:`MAX_WAITERS` calls already wait. Awaited on the event loop without
        blocking it (the fetch thread wakes the loop)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] | None = None
        with self._lock:
            need, start = self._due(kid)
            if need and self._in_flight and len(self._waiters) < MAX_WAITERS:
                waiter = loop.create_future()
                self._waiters.append((loop, waiter))
        if start:
            self._wake.set()
        if waiter is None:
            return
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                if (loop, waiter) in self._waiters:
                    self._waiters.remove((loop, waiter))

    def close(self) -> None:
        """Stops the refreshing thread."""
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        wait = 0.0
        while True:
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                go = self._in_flight or time.monotonic() - self._tried_at >= MIN_REFETCH_S
                if go:
                    self._claim()
            if go:
                self._refresh()
            with self._lock:
                ok = self._error is None and self._fetched_at is not None
            wait = self.provider.jwks_refresh_s if ok else min(self.provider.jwks_refresh_s, RETRY_S)

    def _due(self, kid: str) -> tuple[bool, bool]:
        """(the keys must be fetched to answer for ``kid``, a fetch starts now: claimed); the lock held."""
        now = time.monotonic()
        stale = self._fetched_at is None or now - self._fetched_at > self.provider.jwks_max_age_s
        need = kid not in self._keys or stale
        start = need and not self._in_flight and now - self._tried_at >= MIN_REFETCH_S
        if start:
            self._claim()
        return need, start

    def _claim(self) -> None:
        """Marks a fetch as due or under way (the lock held): calls that need it may await its end."""
        self._in_flight = True

    def _refresh(self) -> None:
        """Fetches the keys (in the thread, without holding the state's lock: a slow provider never
        holds up a check with its key in hand); on failure keeps those it has and notes why."""
        with self._lock:
            self._tried_at = time.monotonic()
        try:
            keys = self._download()
        except (OSError, ValueError) as exc:
            log.warning("OpenID provider %s: its keys could not be fetched: %s", self.provider.name, exc)
            with self._lock:
                self._error = str(exc)
            return
        else:
            with self._lock:
                self._keys, self._fetched_at, self._error = keys, time.monotonic(), None
        finally:
            with self._lock:
                self._in_flight = False
                waiters, self._waiters = self._waiters, []
            for loop, waiter in waiters:
                with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                    loop.call_soon_threadsafe(_wake, waiter)

    def _download(self) -> dict[str, tuple[jwt.PyJWK, str | None]]:
        p = self.provider
        if self._jwks_uri is None:
            url = p.issuer.rstrip("/") + "/.well-known/openid-configuration"
            doc = _json(self._fetch(url, p.timeout_s, self._context), url)
            if doc.get("issuer") != p.issuer:
                raise ValueError(f"{url} names issuer {doc.get('issuer')!r}, not {p.issuer!r}")
            if not isinstance(doc.get("jwks_uri"), str):
                raise ValueError(f"{url} names no jwks_uri")
            if not oidc_url_allowed(doc["jwks_uri"]):
                raise ValueError(f"{url} names jwks_uri {doc['jwks_uri'][:200]!r}: not https (http only on loopback)")
            self._jwks_uri = doc["jwks_uri"]
        url = self._jwks_uri
        listed = _json(self._fetch(url, p.timeout_s, self._context), url).get("keys")
        keys = {}
        for k in listed if isinstance(listed, list) else []:
            if not isinstance(k, dict) or k.get("use", "sig") != "sig" or not isinstance(k.get("kid"), str):
                continue
            try:
                keys[k["kid"]] = (jwt.PyJWK(k), k.get("alg") if isinstance(k.get("alg"), str) else None)
            except jwt.PyJWTError as exc:
                log.warning("OpenID provider %s: key %s skipped: %s", p.name, k.get("kid"), exc)
        if not keys:
            raise ValueError(f"{url} holds no signing key with a kid")
        return keys


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _json(body: bytes, url: str) -> dict:
    try:
        doc = json.loads(body)
    except ValueError:
        raise ValueError(f"{url} is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{url} is not a JSON object")
    return doc


def looks_like_jwt(token: str) -> bool:
    """Three base64url parts, the first a JSON object's encoding (``eyJ``): a JWT, not a static token."""
    return token.count(".") == 2 and token.startswith("eyJ")


class OIDCVerifier:
    """Checks tokens of the configured providers (see the module docstring)."""

    def __init__(self, providers: list[OIDCProviderSection], fetch: Fetch = http_get) -> None:
        self.providers = {p.issuer: p for p in providers}
        self.keys = {p.issuer: KeySet(p, fetch) for p in providers}
        self._verified: dict[str, Principal] = {}
        self._lock = threading.Lock()

    async def ready(self, token: str) -> None:
        """Awaits the fetch of the keys ``token`` needs where its key id is not yet known (see
        :meth:`KeySet.fetched`), so that :meth:`verify` can answer; never raises (verify says why not)."""
        if self._remembered(token) is not None:
            return
        try:
            header, unverified = _unverified(token)
        except jwt.PyJWTError:
            return
        iss, kid = unverified.get("iss"), header.get("kid")
        keys = self.keys.get(iss) if isinstance(iss, str) else None
        if keys is not None and isinstance(kid, str):
            await keys.fetched(kid)

    def verify(self, token: str) -> Principal:
        """Who ``token`` is; RouterError UNAUTHENTICATED (a check failed) or PERMISSION_DENIED (no rule).
        Never waits (a key id not yet fetched is refused: :meth:`ready` first awaits its fetch)."""
        known = self._remembered(token)
        if known is not None:
            return known
        digest, now = _digest(token), time.time()
        principal = self._check(token)
        with self._lock:
            if len(self._verified) >= MAX_REMEMBERED:
                self._verified = {k: v for k, v in self._verified.items() if v.expires > now}
            if len(self._verified) < MAX_REMEMBERED:
                self._verified[digest] = principal
        return principal

    def close(self) -> None:
        for ks in self.keys.values():
            ks.close()

    def _remembered(self, token: str) -> Principal | None:
        with self._lock:
            known = self._verified.get(_digest(token))
        return known if known is not None and known.expires > time.time() else None

    def _check(self, token: str) -> Principal:
        try:
            header, unverified = _unverified(token)
        except jwt.PyJWTError as exc:
            raise _refused(f"it is not a JWT ({exc})") from None
        iss = unverified.get("iss")
        p = self.providers.get(iss) if isinstance(iss, str) else None
        if p is None:
            raise _refused(f"its issuer {str(iss)[:200]!r} is not an accepted provider (identity.oidc issuers: "
                           f"{', '.join(sorted(self.providers))})")
        alg = header.get("alg")
        if alg not in p.algorithms:
            raise _refused(f"its algorithm {str(alg)[:20]!r} is not accepted for provider {p.name} "
                           f"(identity.oidc algorithms: {', '.join(p.algorithms)})")
        kid = header.get("kid")
        if not isinstance(kid, str):
            raise _refused("its header names no key id (kid)")
        key, key_alg = self.keys[p.issuer].key(kid)
        if key_alg is not None and key_alg != alg:
            raise _refused(f"its algorithm {alg} is not that of provider {p.name}'s key {kid[:100]!r} ({key_alg})")
        claims = _decode(token, key, alg, p)
        return Principal(str(claims["sub"]), p.issuer, p.name, *_rule(claims, p), float(claims["exp"]))


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _unverified(token: str) -> tuple[dict, dict]:
    """The header and claims of ``token``, nothing checked; jwt.PyJWTError when it is no JWT."""
    return jwt.get_unverified_header(token), jwt.decode(token, options={"verify_signature": False})


def _decode(token: str, key: jwt.PyJWK, alg: str, p: OIDCProviderSection) -> dict:
    """The token's claims, its signature, audience, issuer and times checked; RouterError naming what failed."""
    try:
        return jwt.decode(token, key.key, algorithms=[alg], audience=p.audience, issuer=p.issuer,
                          leeway=p.clock_skew_s, options={"require": ["exp", "iat", "sub", "aud", "iss"]})
    except jwt.ExpiredSignatureError:
        raise _refused(f"it expired (exp; clock skew allowed: {p.clock_skew_s:g} s)") from None
    except jwt.ImmatureSignatureError:
        raise _refused(f"it is not valid yet (nbf or iat; clock skew allowed: {p.clock_skew_s:g} s)") from None
    except jwt.InvalidAudienceError:
        raise _refused(f"its audience is not this service's ({p.audience!r}, provider {p.name})") from None
    except jwt.InvalidIssuerError:
        raise _refused(f"its issuer is not {p.issuer!r}") from None
    except jwt.InvalidSignatureError:
        raise _refused(f"its signature does not verify against provider {p.name}'s key") from None
    except jwt.MissingRequiredClaimError as exc:
        raise _refused(f"it lacks the {exc.claim!r} claim") from None
    except jwt.PyJWTError as exc:
        raise _refused(f"{exc}") from None


def _rule(claims: dict, p: OIDCProviderSection) -> tuple[str | None, str | None]:
    """(tenant, operator) of the first rule the claims match; PERMISSION_DENIED when none does."""
    for rule in p.rules:
        if _holds(claims.get(rule.claim), rule):
            return rule.tenant, rule.operator
    raise RouterError(ErrorKind.PERMISSION_DENIED,
                      f"the token of {str(claims.get('sub'))[:200]!r} at provider {p.name} matches none of its "
                      f"rules (identity.oidc[].rules: {', '.join(f'{r.claim}={r.value}' for r in p.rules)})")


def _holds(value: object, rule: ClaimRule) -> bool:
    if isinstance(value, str):
        return value == rule.value
    if isinstance(value, list):
        return rule.value in value
    return False


__all__ = ["INLINE_WAIT_S", "MAX_WAITERS", "MIN_REFETCH_S", "RETRY_S", "KeySet", "OIDCVerifier", "Principal",
           "http_get", "looks_like_jwt"]
