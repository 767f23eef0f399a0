"""Tenants' quotas across several routers (``routers:``).

Every ``EXCHANGE_S`` each router writes what it took of each tenant's quotas
since it started (requests, tokens net of what finished requests gave back)
and the tenant's requests in progress there, as one JSON value under its own
etcd lease (``quotas/<router>``), and applies the others' latest, which its
membership watch (router/cluster/membership.py) hands it as they change. What another
router took since it last wrote is charged to this router's buckets (past
zero if need be: a debt that refills as any other); the others' requests in
progress count against ``max_concurrent``. So every router's buckets follow
the tenant's use at all of them, each a little behind the others' latest. The
tokens a tenant was admitted elsewhere also move its requests waiting here
back in the fair queue (``FairQueue.served_elsewhere``): its weight holds
across the routers, not at each alone.

Tolerance: a router admits against buckets that lack what the others admitted
since their last write, at most ``EXCHANGE_S`` plus an etcd round trip ago. A
tenant over its quota is refused everywhere within about that long; what it
gets past a quota is at most what the other routers admitted it in that
window (a tenant sending at its quota's rate from several routers at once:
about ``(R - 1) / R`` of a second's worth; a full minute's bucket spent at
every router in the same second: up to R times the bucket, once, then every
router's bucket is in debt until the refills pay it). etcd unreachable: each
router enforces the quotas on its own traffic only, and catches up when it
is back (the counters are cumulative). Requests in progress at a router that
died stop counting when its lease ends."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from kvrelay.router.cluster.shared_values import BadValue
from kvrelay.router.core.admission import FairQueue
from kvrelay.router.core.quotas import Quotas
from kvrelay.router.core.tenancy import TenantPolicies
from kvrelay.runtime.etcd import EtcdClient, EtcdError

log = logging.getLogger(__name__)

EXCHANGE_S = 1.0
"""How often a router writes its figures and reads the others'."""


MAX_FIGURE = 1 << 53
MAX_FIGURES_BYTES = 1 << 20


def parse_figures(value: bytes) -> dict[str, list[int]]:
    """One router's figures, checked (BadValue naming what is wrong)."""
    if len(value) > MAX_FIGURES_BYTES:
        raise BadValue(f"{len(value)} bytes of quota figures, over {MAX_FIGURES_BYTES}")
    try:
        figures = json.loads(value)
    except ValueError:
        raise BadValue("not JSON: not a router's quota figures") from None
    if not isinstance(figures, dict):
        raise BadValue("not a JSON object of tenant -> figures")
    for tenant, fig in figures.items():
        if not (isinstance(fig, list) and len(fig) in (3, 4)
                and all(type(x) is int and 0 <= x <= MAX_FIGURE for x in fig)):
            raise BadValue(f"tenant {tenant[:80]!r}: figures must be [requests, tokens, running, admitted], counts "
                           f"in 0..{MAX_FIGURE}")
    return figures


class QuotaExchange:
    """One router's side of the exchange (module docstring)."""

    def __init__(self, client: EtcdClient, prefix: str, me: str, quotas: Quotas, tenants: TenantPolicies,
                 lease: Callable[[], int], queue: FairQueue | None = None,
                 routers: frozenset[str] | None = None) -> None:
        """``lease``: this router's current etcd lease (its key goes when the router does); ``queue``: the fair
        queue the others' service is charged to; ``routers``: the configured routers, whose figures alone
        are taken (None: any name)."""
        self.routers = routers
        self.client, self.key, self.prefix = client, f"{prefix}quotas/{me}", f"{prefix}quotas/"
        self.quotas, self.tenants, self.lease, self.queue = quotas, tenants, lease, queue
        self.seen: dict[str, dict[str, tuple[int, int, int]]] = {}
        self.latest: dict[str, dict] = {}
        """Each other router's last figures, as the membership watch delivered them."""
        """Per other router: each tenant's figures already charged here."""

    def mine(self) -> bytes:
        """This router's figures: tenant -> [requests, tokens, running, admitted tokens]."""
        q = self.quotas
        return json.dumps({t: [k.requests, k.tokens, q.state[t].running if t in q.state else 0, k.admitted]
                           for t, k in q.taken.items()}, sort_keys=True).encode()

    def apply(self, others: dict[str, dict[str, list[int]]]) -> None:
        """The other routers' figures (router -> tenant -> [requests, tokens, running, admitted]): charges what
        each took since the last time, and sets each tenant's requests in progress elsewhere."""
        running: dict[str, int] = {}
        for router, figures in others.items():
            first = router not in self.seen  # a router seen for the first time: its past is not charged
            seen = self.seen.setdefault(router, {})
            for tenant, fig in figures.items():
                if not self.tenants.known(tenant):
                    continue
                requests, tokens, now_running, admitted = (*fig[:3], fig[3] if len(fig) > 3 else 0)
                before = seen.get(tenant, (0, 0, 0))
                if requests < before[0]:  # that router restarted: its counts start again
                    before = (0, 0, 0)
                seen[tenant] = (requests, tokens, admitted)
                if not first:
                    self._charge(tenant, requests - before[0], tokens - before[1], admitted - before[2])
                running[tenant] = running.get(tenant, 0) + now_running
        for gone in [r for r in self.seen if r not in others]:
            del self.seen[gone]
        for tenant in set(running) | {t for t, st in self.quotas.state.items() if st.remote_running}:
            if self.tenants.known(tenant):
                self.quotas.set_remote_running(self.tenants.of(tenant), running.get(tenant, 0))

    def _charge(self, tenant: str, requests: int, tokens: int, admitted: int) -> None:
        policy = self.tenants.of(tenant)
        self.quotas.charge(policy, requests, tokens)
        if self.queue is not None:
            self.queue.served_elsewhere(tenant, admitted, policy.weight)

    def take(self, router: str, value: bytes | None) -> None:
        """A router's figures as etcd changed them (None: its key went with its lease); this router's own
        are ignored. BadValue (nothing taken) unless ``router`` is a configured router's and the value
        its figures: tenant -> [requests, tokens, running(, admitted)], counts in 0..2**53."""
        if self.prefix + router == self.key:
            return
        if value is None:
            self.latest.pop(router, None)
            return
        if self.routers is not None and router not in self.routers:
            raise BadValue(f"router {router[:80]!r} is not one of the config's routers")
        self.latest[router] = parse_figures(value)

    async def exchange(self) -> None:
        """One round: apply the others' latest figures, write this router's."""
        self.apply(dict(self.latest))
        await self.client.put(self.key, self.mine(), self.lease())

    async def run(self) -> None:
        """Exchanges every EXCHANGE_S until cancelled; a round etcd does not answer is skipped."""
        while True:
            try:
                await self.exchange()
            except EtcdError as exc:
                log.debug("quota exchange skipped: %s", exc)
            await asyncio.sleep(EXCHANGE_S)
