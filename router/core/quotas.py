"""Per-tenant quotas at admission: token buckets of requests and of tokens
per minute, and a count of requests in progress.

A bucket holds a minute's worth (so a tenant idle for a minute may send
that much at once) and refills continuously. A request takes one request
and ``prompt + max_tokens`` tokens; what it did not generate is returned
when it ends. A request larger than a whole bucket is let through when the
bucket is full and leaves it in debt, so no size is refused outright.
Over a quota: :class:`~kvrelay.router.core.errors.RouterError` OVERLOADED (gRPC
RESOURCE_EXHAUSTED, HTTP 429 with ``Retry-After``) naming the quota and
when to retry (:class:`QuotaExceeded`; the job runner pauses that tenant's
jobs for that long, not everyone's).

With several routers (router/core/shared_quotas.py) each router also counts
what it took (``taken``) and is charged what the others took (:meth:`charge`),
and counts their requests in progress (:meth:`set_remote_running`): a
tenant's quotas hold across the routers together, each router a second or so
behind the others' latest."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.runtime.tenants import TenantSection

CONCURRENCY_RETRY_S = 1.0
"""Retry hint when a tenant has ``max_concurrent`` requests in progress (no refill time to compute)."""


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    per_s: float
    level: float
    at: float
    """When ``level`` was last brought up to date (the quotas' clock)."""

    @classmethod
    def per_minute(cls, amount: int, now: float) -> TokenBucket:
        return cls(float(amount), amount / 60.0, float(amount), now)

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now

    def wait_s(self, amount: float, now: float) -> float:
        """0 when ``amount`` can be taken now, else the seconds until it can."""
        self._refill(now)
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.per_s

    def take(self, amount: float) -> None:
        self.level -= amount

    def give(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass(slots=True)
class _TenantState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    running: int = 0
    remote_running: int = 0
    """Its requests in progress at the other routers (as they last said)."""


@dataclass(slots=True)
class Taken:
    """What this router took of one tenant's quotas since it started: requests, and tokens net of
    what finished requests gave back (the figures it shares with the other routers)."""

    requests: int = 0
    tokens: int = 0
    admitted: int = 0
    """Tokens of the requests admitted (prompt + max_tokens, nothing given back): the fair queue's cost."""


@dataclass(slots=True)
class Grant:
    """One admitted request's share of its tenant's quotas; :meth:`Quotas.release` returns it."""

    tenant: str
    tokens: int
    released: bool = field(default=False)


class Quotas:
    """Every tenant's quotas (tenants with none configured pass freely)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.state: dict[str, _TenantState] = {}
        self.taken: dict[str, Taken] = {}
        """Per tenant: what this router took (shared with the other routers)."""

    def _of(self, policy: TenantSection) -> _TenantState:
        st = self.state.get(policy.name)
        if st is None:
            now = self.clock()
            rpm, tpm = policy.requests_per_minute, policy.tokens_per_minute
            st = _TenantState(TokenBucket.per_minute(rpm, now) if rpm else None,
                              TokenBucket.per_minute(tpm, now) if tpm else None)
            self.state[policy.name] = st
        return st

    def refusal(self, policy: TenantSection, tokens: int) -> QuotaExceeded | None:
        """Why ``policy``'s tenant may not start a request of ``tokens`` now (None: it may)."""
        st, now, name = self._of(policy), self.clock(), policy.name
        if policy.max_concurrent is not None and st.running + st.remote_running >= policy.max_concurrent:
            return _over(name, f"max_concurrent quota ({policy.max_concurrent} requests in progress)",
                         CONCURRENCY_RETRY_S)
        if st.requests is not None and (wait := st.requests.wait_s(1, now)) > 0:
            return _over(name, f"requests_per_minute quota ({policy.requests_per_minute})", wait)
        if st.tokens is not None and (wait := st.tokens.wait_s(tokens, now)) > 0:
            return _over(name, f"tokens_per_minute quota ({policy.tokens_per_minute}; this request holds "
                               f"{tokens}: prompt + max_tokens)", wait)
        return None

    def admit(self, policy: TenantSection, tokens: int) -> Grant:
        """Takes a request's share, or raises RouterError OVERLOADED naming the quota."""
        problem = self.refusal(policy, tokens)
        if problem is not None:
            raise problem
        return self._take(policy, tokens)

    def take_submission(self, policy: TenantSection) -> QuotaExceeded | None:
        """A batch job's submission takes one request of ``requests_per_minute`` (its requests
        take theirs as they run); None when taken, else why not (nothing taken)."""
        st = self._of(policy)
        if st.requests is None:
            return None
        wait = st.requests.wait_s(1, self.clock())
        if wait > 0:
            return _over(policy.name, f"requests_per_minute quota ({policy.requests_per_minute}; a job "
                                      "submission counts as one request)", wait)
        st.requests.take(1)
        self._count(policy.name, 1, 0)
        return None

    def _count(self, tenant: str, requests: int, tokens: int) -> None:
        t = self.taken.setdefault(tenant, Taken())
        t.requests += requests
        t.tokens += tokens
        t.admitted += max(0, tokens)

    def charge(self, policy: TenantSection, requests: int, tokens: int) -> None:
        """What another router took of ``policy``'s tenant's quotas since it last said (tokens below
        zero: given back): taken here too, past zero if need be (the debt refills as any other)."""
        st = self._of(policy)
        if st.requests is not None and requests > 0:
            st.requests.take(requests)
        if st.tokens is not None:
            (st.tokens.take if tokens > 0 else st.tokens.give)(abs(tokens))

    def set_remote_running(self, policy: TenantSection, running: int) -> None:
        """``policy``'s tenant's requests in progress at the other routers together."""
        self._of(policy).remote_running = running

    def _take(self, policy: TenantSection, tokens: int) -> Grant:
        st = self._of(policy)
        st.running += 1
        if st.requests is not None:
            st.requests.take(1)
        if st.tokens is not None:
            st.tokens.take(tokens)
        self._count(policy.name, 1, tokens)
        return Grant(policy.name, tokens)

    def release(self, grant: Grant, used_tokens: int) -> None:
        """The request ended having used ``used_tokens`` of what it held (the rest goes back)."""
        if grant.released:
            return
        grant.released = True
        st = self.state[grant.tenant]
        st.running -= 1
        back = max(0, grant.tokens - used_tokens)
        if st.tokens is not None:
            st.tokens.give(back)
        self._count(grant.tenant, 0, -back)


class QuotaExceeded(RouterError):
    """OVERLOADED because of the tenant's own quota (not the cluster's capacity)."""

    def __init__(self, tenant: str, message: str, retry_after_s: float) -> None:
        super().__init__(ErrorKind.OVERLOADED, message, retry_after_s)
        self.tenant = tenant


def _over(tenant: str, quota: str, wait_s: float) -> QuotaExceeded:
    ms = max(1, int(wait_s * 1e3 + 0.999))
    return QuotaExceeded(tenant, f"tenant {tenant!r} is over its {quota}; retry in {ms} ms", ms / 1e3)
