"""Bearer tokens as the config names them: by their SHA-256, never the token
itself (``auth.operators``, ``tenants``). Its own module so that `kvrelay
token` and the launchers compute it without loading the router."""

from __future__ import annotations

import hashlib


def token_sha256(token: str) -> str:
    """The digest the config lists for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()
