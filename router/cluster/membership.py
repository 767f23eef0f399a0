"""Which routers serve the deployment, and which workers every router knows.

One router (the default): :class:`SoloMembership`, nothing shared. Several
(``routers:``): :class:`EtcdMembership` keeps, in etcd under ``etcd.prefix``,

- ``routers/<name>``: each live router (a ``RouterPeer``), under its own lease
  (``etcd.lease_ttl_s``), renewed every third of it: a router that dies leaves
  the list within one TTL;
- ``workers/<worker id>``: each registered worker's ``WorkerInfo``, written by
  the router that accepted its registration (after checking its certificate)
  and deleted when it deregisters;
- ``pools/<site>/<role>``: each pool's desired size as the last router that
  changed it (scale, drain, the planner) set it, and ``drains/<worker id>``:
  the workers a router chose to drain; every router then places nothing more
  on them, and a worker leaves once every router it heartbeats says its
  requests there are done.

Every value read is checked first (router/cluster/shared_values.py): one that
fails is skipped, with an audit record (``on_refused``) naming its key and why, and
the watch goes on past it; only the routers may write these keys (etcd's roles,
launch/etcd_auth.py). Every router watches both prefixes and applies them to its own registry: a
worker learned from etcd is dialled but counts as healthy only once its own
heartbeat arrives here (each worker heartbeats every live router, which it
learns from the routers' answers). Placement reads the registry only, never
etcd. When etcd cannot be reached, a router serves on with the last
membership it read, refuses new registrations (UNAVAILABLE, naming etcd) and
says so in its status; it catches up from where its watch stopped when etcd
is back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from kvrelay.router.cluster import shared_values
from kvrelay.router.cluster.pools import PoolManager
from kvrelay.router.cluster.registry import WorkerRegistry
from kvrelay.router.cluster.shared_values import SharedNames
from kvrelay.runtime.config import EtcdSection
from kvrelay.runtime.etcd import Change, EtcdClient, EtcdError
from kvrelay.runtime.roles import Role
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

RETRY_S = 0.5
"""Pause before a broken watch or a failed renewal is tried again."""
STALE_WORKER_S = 60.0
"""A worker no router heard for this long (and 10 heartbeat timeouts) is removed from etcd, by the
live router first by name: a worker that crashed does not stay listed for ever."""


class Membership(Protocol):
    """The routers of the deployment and the workers they share."""

    @property
    def me(self) -> ipb.RouterPeer:
        """This router (its addresses once it listens)."""
        ...

    def peers(self) -> list[ipb.RouterPeer]:
        """Every live router, this one included, by name."""
        ...

    def coordination(self) -> str:
        """The shared store's state for status ("" with one router)."""
        ...

    async def start(self, me: ipb.RouterPeer) -> None: ...

    async def publish_worker(self, info: wpb.WorkerInfo) -> None:
        """A worker this router registered, for every other router (RouterError-free: EtcdError when it cannot)."""
        ...

    async def forget_worker(self, worker_id: str) -> None:
        """A worker that left, for every other router (best effort: logged when it cannot)."""
        ...

    def can_change_pools(self) -> str | None:
        """None when pool sizes and drains can be shared now, else why not."""
        ...

    async def publish_pool(self, site: str, role: Role, desired: int, drained: list[str]) -> None:
        """A pool's new desired size and the workers this router drains for it, for every other router
        (best effort: logged when it cannot; callers ask :meth:`can_change_pools` first)."""
        ...

    async def aclose(self) -> None: ...


class SoloMembership:
    """One router: nothing to share."""

    def __init__(self) -> None:
        self._me = ipb.RouterPeer()

    @property
    def me(self) -> ipb.RouterPeer:
        return self._me

    def peers(self) -> list[ipb.RouterPeer]:
        return [self._me]

    def coordination(self) -> str:
        return ""

    async def start(self, me: ipb.RouterPeer) -> None:
        self._me = me

    async def publish_worker(self, info: wpb.WorkerInfo) -> None:
        return None

    async def forget_worker(self, worker_id: str) -> None:
        return None

    def can_change_pools(self) -> str | None:
        return None

    async def publish_pool(self, site: str, role: Role, desired: int, drained: list[str]) -> None:
        return None

    async def aclose(self) -> None:
        return None


class EtcdMembership:
    """Routers and workers shared through etcd (module docstring)."""

    def __init__(self, section: EtcdSection, client: EtcdClient, registry: WorkerRegistry,
                 pools: PoolManager, names: SharedNames) -> None:
        """``names``: the routers and sites the config lists, which the values read must name."""
        self.section, self.client, self.registry, self.pools = section, client, registry, pools
        self.names = names
        self.on_refused: Callable[[str, int, str], None] | None = None
        """Told of each value not applied: (key, revision, why) (the router audits it)."""
        self.drains: set[str] = set()
        """Workers some router drains (applied to each as this router learns it)."""
        self.on_quotas: Callable[[str, bytes | None], None] | None = None
        """Where the routers' quota figures (``quotas/<router>``) go as they change (router/core/shared_quotas.py)."""
        self._me = ipb.RouterPeer()
        self.routers: dict[str, ipb.RouterPeer] = {}
        self.lease = 0
        self.revision = 0
        """The last store revision applied here (the watch resumes after it)."""
        self.down_since: float | None = None
        """When etcd stopped answering (wall clock; None: it answers)."""
        self.last_error = ""
        self._tasks: list[asyncio.Task] = []

    @property
    def me(self) -> ipb.RouterPeer:
        return self._me

    def _key(self, kind: str, name: str) -> str:
        return f"{self.section.prefix}{kind}/{name}"

    def peers(self) -> list[ipb.RouterPeer]:
        return [self.routers[n] for n in sorted(self.routers)]

    def coordination(self) -> str:
        eps = ", ".join(self.client.endpoints)
        if self.down_since is None:
            return f"etcd at {eps}: reached; {len(self.routers)} router(s) live"
        since = time.strftime("%H:%M:%S", time.gmtime(self.down_since))
        return (f"etcd at {eps}: UNREACHABLE since {since} UTC ({self.last_error}); serving the last known "
                f"membership ({len(self.routers)} router(s), {len(self.registry.workers)} worker(s)), "
                "refusing new registrations")

    async def start(self, me: ipb.RouterPeer) -> None:
        """Joins: reaches etcd (EtcdError naming the endpoints when it cannot), takes a lease,
        announces this router, reads the routers and workers, then keeps all of it current."""
        self._me = me
        await self.client.connect()
        self.lease = await self.client.grant(self.section.lease_ttl_s)
        await self.client.put(self._key("routers", me.name), me.SerializeToString(), self.lease)
        await self._read_all()
        self._tasks = [asyncio.create_task(self._renew(), name="etcd-lease"),
                       asyncio.create_task(self._watch(), name="etcd-watch")]

    async def _read_all(self) -> None:
        """Everything under the prefix, applied (at start, and after the watch lost its place)."""
        entries, self.revision = await self.client.get_prefix(self.section.prefix)
        routers, workers = {}, {}
        self.drains = set()
        for e in entries:
            kind, _, name = e.key[len(self.section.prefix):].partition("/")
            try:
                if kind == "routers":
                    routers[name] = shared_values.router_peer(self.names, name, e.value)
                elif kind == "workers":
                    workers[name] = shared_values.worker_info(self.names, name, e.value)
                else:
                    self._apply_other(kind, name, e.value)
            except shared_values.BadValue as exc:
                self._refused(e.key, e.mod_revision, str(exc))
        self.routers = routers
        for worker_id in [w for w in self.registry.workers if w not in workers]:
            await self.registry.deregister(worker_id)
        for info in workers.values():
            await self._learn(info)

    def _refused(self, key: str, revision: int, why: str) -> None:
        log.warning("not applying etcd's %s (revision %d): %s", key[:200], revision, why)
        if self.on_refused is not None:
            self.on_refused(key[:200], revision, why)

    async def _learn(self, info: wpb.WorkerInfo) -> None:
        await self.registry.learn(info)
        if info.worker_id in self.drains:
            self.pools.start_drain(self.registry.workers[info.worker_id])

    def _apply_other(self, kind: str, name: str, value: bytes | None) -> None:
        """A pool's desired size or a drain another router decided (a pool the config lacks is refused),
        or a router's quota figures (to ``on_quotas``, which checks them). BadValue: not applied."""
        if kind == "quotas":
            if self.on_quotas is not None:
                self.on_quotas(name, value)
        elif kind == "drains":
            if value is None:
                self.drains.discard(name)
                return
            self.drains.add(shared_values.drain(name, value))
            rec = self.registry.workers.get(name)
            if rec is not None:
                self.pools.start_drain(rec)
        elif kind == "pools":
            if value is not None:
                key, size = shared_values.pool_size(self.names, name, value)
                if key in self.pools.desired:
                    self.pools.desired[key] = size
        else:
            raise shared_values.BadValue(f"{kind[:40]!r} is not a kind of key the routers keep")

    async def _apply(self, ch: Change) -> None:
        """One change, checked and applied; a value that fails its check is skipped (and audited)."""
        kind, _, name = ch.key[len(self.section.prefix):].partition("/")
        try:
            if kind == "routers":
                if ch.value is None:
                    if self.routers.pop(name, None) is not None:
                        log.warning("router %s left the deployment (its etcd lease ended)", name)
                else:
                    self.routers[name] = shared_values.router_peer(self.names, name, ch.value)
            elif kind == "workers":
                if ch.value is None:
                    if await self.registry.deregister(name):
                        log.info("worker %s left (etcd)", name)
                else:
                    await self._learn(shared_values.worker_info(self.names, name, ch.value))
            else:
                self._apply_other(kind, name, ch.value)
        except shared_values.BadValue as exc:
            self._refused(ch.key, ch.revision, str(exc))
        finally:  # applied or skipped, never read again: the watch goes on past it
            self.revision = max(self.revision, ch.revision)

    async def _watch(self) -> None:
        """Applies every change as it happens; a broken watch moves to the next member at once
        (etcd is unreachable only when every member failed in a row)."""
        failures = 0
        while True:
            try:
                async for batch in self.client.watch(self.section.prefix, self.revision + 1):
                    failures = 0
                    for ch in batch:
                        await self._apply(ch)
            except EtcdError as exc:
                failures += 1
                if failures >= len(self.client.endpoints):
                    self._unreachable(exc)
                    await asyncio.sleep(RETRY_S)
                if "compacted" in str(exc):
                    with contextlib.suppress(EtcdError):
                        await self._read_all()
            except Exception:  # a bug here must not leave this router deaf to the others
                log.exception("applying etcd's changes failed; watching again from revision %d", self.revision + 1)
                await asyncio.sleep(RETRY_S)

    async def _renew(self) -> None:
        """Renews the lease every third of its TTL; a lease that ended (etcd was away longer
        than its TTL) is replaced and this router announced again."""
        period = self.section.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period if self.down_since is None else RETRY_S)
            try:
                if await self.client.keepalive(self.lease) <= 0:
                    log.warning("this router's etcd lease ended; announcing it again")
                    self.lease = await self.client.grant(self.section.lease_ttl_s)
                    await self.client.put(self._key("routers", self._me.name), self._me.SerializeToString(),
                                          self.lease)
                if self.down_since is not None:
                    log.warning("etcd is reachable again")
                    self.down_since = None
                for worker_id in self._stale_workers():
                    log.warning("worker %s silent for over %.0f s: removing it from etcd", worker_id, STALE_WORKER_S)
                    await self.forget_worker(worker_id)
            except EtcdError as exc:
                self._unreachable(exc)

    def _stale_workers(self) -> list[str]:
        """Workers silent here for long, when this router is the one that sweeps (first by name)."""
        if not self.routers or min(self.routers) != self._me.name:
            return []
        limit = time.monotonic() - max(STALE_WORKER_S, 10 * self.registry.timeout_s)
        return [w for w, rec in self.registry.workers.items() if max(rec.last_seen, rec.registered_at) < limit]

    def _unreachable(self, exc: EtcdError) -> None:
        if self.down_since is None:
            log.warning("etcd unreachable: %s; serving the last known membership", exc)
            self.down_since = time.time()
        self.last_error = str(exc)[:300]

    async def publish_worker(self, info: wpb.WorkerInfo) -> None:
        await self.client.put(self._key("workers", info.worker_id), info.SerializeToString())

    async def forget_worker(self, worker_id: str) -> None:
        try:
            await self.client.delete(self._key("workers", worker_id))
            await self.client.delete(self._key("drains", worker_id))
        except EtcdError as exc:  # the others drop it when it stops heartbeating them (and the sweep removes it)
            log.warning("could not remove %s from etcd: %s", worker_id, exc)

    def can_change_pools(self) -> str | None:
        if self.down_since is None:
            return None
        return (f"pool sizes and drains are shared by the routers through etcd, unreachable now "
                f"({self.last_error}); change them when it is back")

    async def publish_pool(self, site: str, role: Role, desired: int, drained: list[str]) -> None:
        try:
            await self.client.put(self._key("pools", f"{site}/{role}"), str(desired).encode())
            for worker_id in drained:
                await self.client.put(self._key("drains", worker_id), b"")
        except EtcdError as exc:  # etcd went away since can_change_pools said it was there
            log.warning("could not share %s/%s's size and drains %s with the other routers: %s", site, role,
                        drained, exc)

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.lease:
            with contextlib.suppress(EtcdError, TimeoutError):  # leaving: the others see it now, not after a TTL
                await asyncio.wait_for(self.client.revoke(self.lease), self.section.timeout_s)
        await self.client.close()
