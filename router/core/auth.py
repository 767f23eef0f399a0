"""Who is calling, for every front end: bearer tokens, certificates, and
the tenants' prefix-cache salts.

``auth.operators`` guard the Admin API and ``ListWorkers``; ``tenants``
name the tenants of the Inference and Jobs APIs (gRPC metadata or the HTTP
header ``authorization: Bearer <token>``), each with its policy. Only SHA-256 digests of tokens
are configured; they are compared in constant time. A certificate from the
cluster CA stands in for a token: role ``operator`` for operators, role
``client`` for a tenant (the certificate's name is the tenant's name, which
must be a configured tenant). An OpenID provider's access token (a JWT, of a
provider in ``identity.oidc``) stands in too, as the tenant or operator its
claims map to (router/core/oidc.py). Nobody is let in without one of these
unless ``auth.allow_anonymous``."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.oidc import OIDCVerifier, Principal, looks_like_jwt
from kvrelay.router.core.tenancy import ANONYMOUS
from kvrelay.runtime.config import ClusterConfig, Credential
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.runtime.tenants import TenantSection, sharing_group
from kvrelay.runtime.tokens import token_sha256

__all__ = ["ANONYMOUS", "BearerAuth", "CallerAuth", "TenantSalts", "token_sha256"]


class BearerAuth:
    """Checks an ``authorization`` value against configured credentials."""

    def __init__(self, credentials: list[Credential], kind: str, listed_in: str) -> None:
        """``kind`` ("operator", "client") and ``listed_in`` (where the config
        lists them) go into the error a caller without credentials gets."""
        self.hashes = [(c.token_sha256, c.name) for c in credentials]
        self.kind = kind
        self.listed_in = listed_in

    @property
    def required(self) -> bool:
        """Credentials are configured, so callers must present one."""
        return bool(self.hashes)

    def who(self, authorization: str) -> str | None:
        """The credential's name, or None when it is missing or wrong."""
        if not authorization.startswith("Bearer "):
            return None
        digest = token_sha256(authorization[len("Bearer "):].strip())
        for want, name in self.hashes:
            if hmac.compare_digest(digest, want):
                return name
        return None

    def require(self, authorization: str) -> str:
        """The caller's name; RouterError(UNAUTHENTICATED) when the credentials are missing or wrong."""
        who = self.who(authorization)
        if who is None:
            raise RouterError(ErrorKind.UNAUTHENTICATED,
                              f"{self.kind} credentials required: metadata 'authorization: Bearer <token>' with a "
                              f"token listed in {self.listed_in}")
        return who



class CallerAuth:
    """Names the caller of a call from its token or its certificate."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.clients = BearerAuth([Credential(t.name, t.token_sha256) for t in cfg.tenants if t.token_sha256],
                                  "client", "tenants")
        self.operators = BearerAuth(cfg.auth.operators, "operator", "auth.operators (kvrelay: --token-file)")
        self.allow_anonymous = cfg.auth.allow_anonymous
        self.tenants = {t.name for t in cfg.tenants}
        self.oidc = OIDCVerifier(cfg.identity.oidc) if cfg.identity.oidc else None
        """Checks OpenID providers' tokens (None: no provider configured)."""

    async def ready(self, authorization: str) -> None:
        """Awaits, without blocking the event loop, the fetch of the OpenID keys the token in
        ``authorization`` needs (a key id not yet known: router/core/oidc.py), so that the checks
        below, which never wait, can answer for it. The asynchronous frontends call it first."""
        token = self._jwt(authorization)
        if token is not None and self.oidc is not None:
            await self.oidc.ready(token)

    def federated(self, authorization: str) -> Principal | None:
        """The principal of an OpenID provider's token in ``authorization``; None when it
        holds none (or no provider is configured); RouterError when the token is refused."""
        token = self._jwt(authorization)
        return None if token is None or self.oidc is None else self.oidc.verify(token)

    def _jwt(self, authorization: str) -> str | None:
        """The JWT bearer token in ``authorization`` where a provider is configured, else None."""
        if self.oidc is None or not authorization.startswith("Bearer "):
            return None
        token = authorization[len("Bearer "):].strip()
        return token if looks_like_jwt(token) else None

    def tenant(self, authorization: str, cert: Identity | None = None) -> str:
        """The tenant of a client call; RouterError(UNAUTHENTICATED) without credentials."""
        if cert is not None:
            if cert.role is not CertRole.CLIENT:
                raise RouterError(ErrorKind.PERMISSION_DENIED,
                                  f"{cert} is a {cert.role} certificate; the Inference and Jobs APIs take a "
                                  "client certificate or a client token")
            if cert.name not in self.tenants:
                raise RouterError(ErrorKind.PERMISSION_DENIED,
                                  f"{cert} names tenant {cert.name!r}, which is not in the config's tenants")
            return cert.name
        principal = self.federated(authorization)
        if principal is not None:
            if principal.tenant is None:
                raise RouterError(ErrorKind.PERMISSION_DENIED, f"{principal.credential} is operator "
                                  f"{principal.operator!r}, not a tenant: the Inference and Jobs APIs serve tenants")
            return principal.tenant
        who = self.clients.who(authorization)
        if who is not None:
            return who
        if self.allow_anonymous and not authorization:
            return ANONYMOUS
        raise RouterError(ErrorKind.UNAUTHENTICATED,
                          "client credentials required: 'authorization: Bearer <token>' with a token listed in "
                          "tenants, or a client certificate from the cluster CA")

    def credential(self, authorization: str, cert: Identity | None = None) -> str:
        """What a client call signed in with, for the audit log (never the token itself)."""
        if cert is not None:
            return f"certificate {cert}"
        principal = self.federated(authorization)
        if principal is not None:
            return principal.credential
        return "token" if authorization else "anonymous"

    def operator(self, authorization: str, cert: Identity | None = None) -> str:
        """The operator making an Admin call; RouterError(UNAUTHENTICATED / PERMISSION_DENIED)."""
        if cert is not None:
            if cert.role is not CertRole.OPERATOR:
                raise RouterError(ErrorKind.PERMISSION_DENIED,
                                  f"{cert} is a {cert.role} certificate; this call needs an operator")
            return str(cert)
        principal = self.federated(authorization)
        if principal is not None:
            if principal.operator is None:
                raise RouterError(ErrorKind.PERMISSION_DENIED,
                                  f"{principal.credential} is tenant {principal.tenant!r}: this call needs an operator")
            return principal.operator
        return self.operators.require(authorization)


    def reader(self, authorization: str, cert: Identity | None = None) -> tuple[str, str | None]:
        """Who reads usage or the data-handling statement: (operator, None) for an
        operator, (tenant, tenant) for a tenant's own credentials (never anonymous, whose
        "own" usage is everyone's); RouterError(UNAUTHENTICATED / PERMISSION_DENIED) otherwise."""
        if cert is not None:
            if cert.role is CertRole.CLIENT:
                tenant = self.tenant(authorization, cert)
                return tenant, tenant
            return self.operator(authorization, cert), None
        principal = self.federated(authorization)
        if principal is not None:
            if principal.tenant is not None:
                return principal.tenant, principal.tenant
            return str(principal.operator), None
        operator = self.operators.who(authorization)
        if operator is not None:
            return operator, None
        client = self.clients.who(authorization)
        if client is not None:
            return client, client
        raise RouterError(ErrorKind.UNAUTHENTICATED,
                          "operator or tenant credentials required: 'authorization: Bearer <token>' with a token "
                          "listed in auth.operators or tenants, or a certificate from the cluster CA")


class TenantSalts:
    """Each tenant's prefix-cache salt, keyed by a secret: the salt reveals
    nothing about the tenant, and nobody without the key can forge one.
    Tenants that agreed to share (``share_prefix_cache_with``, both sides)
    get one salt for their group."""

    def __init__(self, key: bytes, tenants: Iterable[TenantSection] = ()) -> None:
        self.key = key
        self.groups = {t.name: sharing_group(t) for t in tenants}

    def of(self, tenant: str) -> str:
        domain = "\0".join(sorted(self.groups.get(tenant, {tenant})))
        return hmac.new(self.key, b"kvrelay prefix-cache salt\0" + domain.encode(), hashlib.sha256).hexdigest()[:32]
