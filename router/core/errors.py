"""What can go wrong with a request at the router, as data: every failure the
core raises is a :class:`RouterError` whose ``kind`` is an :class:`ErrorKind`.
Each front end maps the kind to its own status (router/frontends/grpc_api.py,
router/frontends/openai_http.py); jobs record it (router/frontends/jobs.py)."""

from __future__ import annotations

import enum


class ErrorKind(enum.StrEnum):
    """Why a request failed; the values name the gRPC status each maps to."""

    INVALID = "invalid_argument"
    """The request itself is wrong (bad field, too long, empty)."""
    UNKNOWN_MODEL = "model_not_found"
    """It names a model this cluster does not serve."""
    NOT_FOUND = "not_found"
    """It names something else that does not exist (for this caller): a job, a worker."""
    UNAUTHENTICATED = "unauthenticated"
    """Credentials are required and missing or wrong."""
    ALREADY_EXISTS = "already_exists"
    """It would take over something another holds (a live worker's id)."""
    PERMISSION_DENIED = "permission_denied"
    """The caller is known but may not do this (a worker certificate calling the Admin API)."""
    CONSTRAINT = "failed_precondition"
    """Its constraints (jurisdictions) exclude every worker; it is not served elsewhere."""
    OVERLOADED = "resource_exhausted"
    """Every eligible worker is full, or it could not start before its deadline; retry later."""
    UNAVAILABLE = "unavailable"
    """No worker can serve it now (none registered, or failures exhausted its retries)."""
    DEADLINE = "deadline_exceeded"
    """Its deadline passed."""
    CANCELLED = "cancelled"
    """The caller went away."""
    INTERNAL = "internal"
    """A worker or the router failed in a way that is not the request's fault."""


class RouterError(Exception):
    """A request failed; ``kind`` says why, ``message`` says what to fix.

    ``retry_after_s``: for OVERLOADED, when trying again may succeed."""

    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message
