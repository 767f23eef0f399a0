"""Each tenant's policy as the router applies it to one request: where it
may be processed (the tenant's jurisdictions intersected with the request's
own, never widened) and how long it may be (``max_context``). Quotas are
router/core/quotas.py; fair admission router/core/admission.py; dedicated pools are a
placement constraint (router/placement/place.py)."""

from __future__ import annotations

from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.runtime.config import ClusterConfig
from kvrelay.runtime.tenants import TenantSection

ANONYMOUS = "anonymous"
"""The one tenant of callers without credentials (``auth.allow_anonymous``)."""


def _shown(names: frozenset[str] | list[str]) -> str:
    return "{" + ", ".join(sorted(names)) + "}"


class TenantPolicies:
    """The configured tenants' policies by name (tenants without an entry,
    such as ``anonymous``, get the defaults of a bare entry)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.by_name = {t.name: t for t in cfg.tenants}
        self.anonymous = cfg.auth.allow_anonymous

    def known(self, tenant: str) -> bool:
        """``tenant`` is configured (or is the anonymous tenant while anonymous callers are allowed)."""
        return tenant in self.by_name or (self.anonymous and tenant == ANONYMOUS)

    def of(self, tenant: str) -> TenantSection:
        """``tenant``'s policy."""
        policy = self.by_name.get(tenant)
        return policy if policy is not None else TenantSection(name=tenant or ANONYMOUS)

    def jurisdictions(self, tenant: str, requested: frozenset[str] | None) -> frozenset[str] | None:
        """Where the request may be processed: its own set intersected with
        the tenant's (None: anywhere). An empty intersection is refused
        (FAILED_PRECONDITION naming both sets): it would be served nowhere."""
        allowed = self.of(tenant).jurisdictions
        if not allowed:
            return requested
        if requested is None:
            return frozenset(allowed)
        both = requested & frozenset(allowed)
        if not both:
            raise RouterError(ErrorKind.CONSTRAINT,
                              f"the request's allowed_jurisdictions {_shown(requested)} and tenant {tenant!r}'s "
                              f"jurisdictions {_shown(allowed)} have nothing in common; it is not served elsewhere")
        return both

    def check_context(self, tenant: str, prompt_tokens: int, max_tokens: int) -> None:
        """Refuses a request longer than the tenant's ``max_context`` (INVALID_ARGUMENT naming the quota)."""
        limit = self.of(tenant).max_context
        if limit is not None and prompt_tokens + max_tokens > limit:
            raise RouterError(ErrorKind.INVALID,
                              f"tenant {tenant!r}'s max_context quota is {limit} tokens; this request needs "
                              f"{prompt_tokens + max_tokens} (prompt {prompt_tokens} + max_tokens {max_tokens})")
