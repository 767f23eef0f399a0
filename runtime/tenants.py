"""Tenant policy in the config (``tenants:``): one entry per tenant with its
credential and what it may do, each bound next to its field. Parsed by
runtime/config.py like every section; the router enforces it (router/core/tenancy.py, router/core/quotas.py,
router/core/admission.py, placement).

Example::

    tenants:
      - name: lab-qc
        token_sha256: 3f...            # or none: the tenant signs in with a client certificate
        jurisdictions: [CA-QC]         # never widened by a request; [] = anywhere
        priority: normal               # high | normal | low: classes served in that order
        weight: 1.0                    # share of its class under contention
        requests_per_minute: 600
        tokens_per_minute: 200000      # prompt + completion
        max_concurrent: 32
        max_context: 4096              # prompt + max_tokens
        share_prefix_cache_with: []    # tenants that list each other share one prefix cache
        job_retention_days: 30
        max_stored_jobs: 100           # batch jobs it stores at once (finished ones until deleted)
        max_stored_job_bytes: 1073741824  # their requests and results on disk
        audit_retention_days: 365
        log_prompts: false             # prompt and output text in its audit records
"""

from __future__ import annotations

import re
from dataclasses import field
from enum import StrEnum
from typing import Annotated

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from kvrelay.engine.config import MAX_TOKENS, SECTION_CONFIG, ConfigSection, FieldError, StringList, choice

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
"""A tenant's name: what its certificate names and what audit and usage records carry."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
MIN_WEIGHT = 1e-6
"""Smallest weight (a smaller one would make a request's virtual cost overflow)."""
_JURISDICTION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_DAYS = 36_500
"""Bound of retention periods: a hundred years."""
_PER_MINUTE = 1_000_000_000
"""Bound of requests per minute: a billion."""


class TenantPriority(StrEnum):
    """Priority classes: under contention, a waiting request of a higher class
    is admitted before any of a lower one; tenants of one class share by weight."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        """0 for the class served first."""
        return list(TenantPriority).index(self)


Priority = Annotated[TenantPriority, choice(TenantPriority, f"one of {', '.join(TenantPriority)}")]


@dataclass(slots=True, config=SECTION_CONFIG)
class TenantSection(ConfigSection):
    name: StrictStr
    """The tenant (an institution or group); a client certificate naming it stands in for the token."""
    token_sha256: StrictStr | None = None
    """Hex SHA-256 of its bearer token (`kvrelay token --client` prints one);
    None: it signs in with a client certificate from the cluster CA only."""
    jurisdictions: StringList = field(default_factory=list)
    """Where its prompts, KV and outputs may be processed; a request's own
    ``allowed_jurisdictions`` is intersected with these. Empty: anywhere."""
    priority: Priority = TenantPriority.NORMAL
    """Its class at admission under contention (high, normal, low)."""
    weight: StrictFloat = Field(default=1.0, ge=MIN_WEIGHT, le=1_000_000)
    """Its share of its class when requests wait (weighted fair queueing)."""
    requests_per_minute: StrictInt | None = Field(default=None, ge=1, le=_PER_MINUTE)
    """Token-bucket quota of requests (a minute's worth may come at once); None: no quota."""
    tokens_per_minute: StrictInt | None = Field(default=None, ge=1, le=1000 * _PER_MINUTE)
    """Quota of prompt + completion tokens (max_tokens is held at admission, the unused part returned)."""
    max_concurrent: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    """Requests of this tenant in progress at once, at most."""
    max_context: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    """Prompt + max_tokens of one request, at most (below the model's own limit)."""
    share_prefix_cache_with: StringList = field(default_factory=list)
    """Tenants whose prompts may hit its prefix cache and it theirs. Sharing
    needs both sides: every tenant of a sharing group lists all the others."""
    job_retention_days: StrictFloat = Field(default=30.0, gt=0, le=_DAYS)
    """Its finished batch jobs (requests and results) are deleted after this."""
    max_stored_jobs: StrictInt = Field(default=100, ge=1, le=1_000_000)
    """Batch jobs it stores at once, queued, running or finished (until deleted): a
    submission past it is refused (RESOURCE_EXHAUSTED naming the quota)."""
    max_stored_job_bytes: StrictInt = Field(default=1 << 30, ge=1, le=1 << 50)
    """Bytes its stored jobs hold on the router's disk (requests, and results as they
    are stored): a submission that would go past it is refused."""
    audit_retention_days: StrictFloat = Field(default=365.0, gt=0, le=_DAYS)
    """Its audit records are deleted (the deletion itself recorded) after this."""
    log_prompts: StrictBool = False
    """Audit records of its requests carry the prompt and output text (default: never)."""
    kv_lossy: StrictBool = True
    """Its KV may cross a link under a lossy codec (links[].kv_codec: int8, fp8, int4); false: always the
    cache's own bytes, whatever the link names."""

    def __post_init__(self) -> None:
        if not TENANT_NAME.match(self.name):
            raise FieldError("name", f"{self.name!r} must be 1-63 letters, digits, '.', '-' or '_'")
        if self.token_sha256 is not None and not _SHA256.fullmatch(self.token_sha256):
            raise FieldError("token_sha256", "must be 64 lowercase hex digits "
                                             "(the SHA-256 of the token; `kvrelay token --client` prints one)")
        for i, j in enumerate(self.jurisdictions):
            if not _JURISDICTION.match(j):
                raise FieldError(f"jurisdictions[{i}]", f"{j!r} is not a jurisdiction code (e.g. CA-QC)")
        if self.name == "anonymous" and self.token_sha256 is not None:
            raise FieldError("token_sha256", "tenant 'anonymous' is the one of callers without credentials "
                                             "(auth.allow_anonymous); it takes no token")


def check_tenants(tenants: list[TenantSection], jurisdictions: set[str]) -> None:
    """Rules across entries: unique names and tokens, jurisdictions some site
    has, and prefix-cache sharing agreed by both sides (ValueError naming the entry)."""
    names: dict[str, int] = {}
    tokens: dict[str, str] = {}
    for i, t in enumerate(tenants):
        if t.name in names:
            raise ValueError(f"tenants[{i}].name: duplicate tenant {t.name!r}")
        names[t.name] = i
        if t.token_sha256 is not None:
            if t.token_sha256 in tokens:
                raise ValueError(f"tenants[{i}].token_sha256: the same token as tenant {tokens[t.token_sha256]!r}")
            tokens[t.token_sha256] = t.name
        for j in t.jurisdictions:
            if j not in jurisdictions:
                raise ValueError(f"tenants[{i}].jurisdictions: no site is in {j!r} "
                                 f"(sites' jurisdictions: {', '.join(sorted(jurisdictions))})")
    for i, t in enumerate(tenants):
        group = sharing_group(t)
        for other in t.share_prefix_cache_with:
            if other == t.name or other not in names:
                raise ValueError(f"tenants[{i}].share_prefix_cache_with: {other!r} is not another tenant")
            theirs = sharing_group(tenants[names[other]])
            if theirs != group:
                raise ValueError(
                    f"tenants[{i}].share_prefix_cache_with: {t.name!r} shares with {sorted(group - {t.name})} but "
                    f"{other!r} with {sorted(theirs - {other})}; a sharing group must list each other")


def sharing_group(t: TenantSection) -> frozenset[str]:
    """The tenants whose prompts share ``t``'s prefix-cache domain (``t`` itself included)."""
    return frozenset([t.name, *t.share_prefix_cache_with])
