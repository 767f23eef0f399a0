"""What the request path records, and to what: the audit's record kinds and the
:class:`Auditor` the core writes them to. The log itself (the hash chain, its
writer thread, retention) is governance's (router/governance/), built on top
of the core and handed to it at construction."""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol


class RecordKind(StrEnum):
    """What a record is about (the audit line's ``kind`` field)."""

    REQUEST = "request"
    OPERATOR = "operator"
    REGISTRATION = "registration"
    JOB = "job"
    RETENTION = "retention"
    RECOVERY = "recovery"
    """The log's own repair: a torn last line moved aside, records dropped by a full writer queue."""
    REFUSAL = "refusal"
    """A call refused before it had a tenant (missing or wrong credentials), rate-limited."""
    READ = "read"
    """A tenant read its own usage or data-handling statement (Admin.Usage, Admin.Governance)."""
    SHARED_VALUE = "shared_value"
    """A value in the routers' shared store (etcd) not applied: its key, revision and why."""


class Auditor(Protocol):
    """Where every component's audit records go: governance's ``AuditWriter`` (queued, written
    and fsynced in batches by a thread of its own; the caller never blocks) in the router,
    its ``AuditLog`` in tools and tests. The composition root (router/main.py) builds one and
    hands it to each writer at construction."""

    def append(self, kind: RecordKind, fields: dict) -> object:
        """Records ``fields`` as one line of kind ``kind`` (a :class:`RecordKind`; anything else: ValueError)."""
        ...

    def append_durable(self, kind: RecordKind, fields: dict, timeout_s: float = 10.0) -> object:
        """Records ``fields`` and returns once the line is on disk (for deletions, which must
        not happen unrecorded); AuditError when it cannot be written within ``timeout_s``."""
        ...
