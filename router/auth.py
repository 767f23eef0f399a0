"""Bearer-token credentials: who is calling, for every front end.

``auth.operators`` guard the Admin API, ``auth.clients`` name the tenants of
the Inference and Jobs APIs (gRPC metadata or the HTTP header
``authorization: Bearer <token>``). Only SHA-256 digests of tokens are
configured; they are compared in constant time."""

from __future__ import annotations

import hashlib
import hmac

from router.errors import ErrorKind, RouterError
from runtime.config import Credential


def token_sha256(token: str) -> str:
    """The digest the config lists for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


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

    def tenant(self, authorization: str) -> str:
        """The tenant of a client call: "" when no client credentials are
        configured (a trusted network), else as :meth:`require`."""
        return self.require(authorization) if self.required else ""
