"""Pool sizes and draining, as the router holds them.

The router holds each pool's desired size; launchers (local processes or
Ray, launch/local.py and launch/ray_backend.py) start workers until the pool
has that many. Scale-down is the router's choice of the least busy workers:
it places nothing more on them, and tells them over their heartbeat to leave
once the requests it has on them are finished (``drained``), or when
``router.pools.drain_timeout_s`` has passed. The Admin API (router/frontends/admin.py) and
the planner's figures read and change it.

With ``router.pools.scaling: external`` an orchestrator (Kubernetes) owns pool
sizes: every worker that registers is kept, none is drained for a pool's
size (the orchestrator would only start it again), a pool's desired size is
the number of its workers that are not draining, and :meth:`scale` is
refused (router/frontends/admin.py says what to change instead)."""

from __future__ import annotations

import builtins
import logging
import time

from kvrelay.router.cluster.planner import PoolFigures, RequestWindow, p90
from kvrelay.router.cluster.registry import WorkerRecord, WorkerRegistry
from kvrelay.runtime.config import ClusterConfig, ScalingOwner
from kvrelay.runtime.roles import Role
from kvrelay.v1 import admin_pb2 as apb

log = logging.getLogger(__name__)


class PoolManager:
    """Desired pool sizes and the draining of workers, over the registry."""

    def __init__(self, cfg: ClusterConfig, registry: WorkerRegistry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.desired: dict[tuple[str, Role], int] = {}
        self.limits: dict[tuple[str, Role], int] = {}
        self.minimum: dict[tuple[str, Role], int] = {}
        for s in cfg.sites:
            for role in Role:
                pool = s.pool(role)
                self.desired[(s.name, role)] = pool.replicas
                self.limits[(s.name, role)] = pool.max_replicas
                self.minimum[(s.name, role)] = pool.min_replicas
        self.window = RequestWindow(cfg.router.pools.planner_window_s)
        """Recently finished requests: the planner's figures."""
        self.external = cfg.router.pools.scaling is ScalingOwner.EXTERNAL
        """An orchestrator sets pool sizes (router.pools.scaling: external)."""

    def _members(self, site: str, role: Role) -> list[WorkerRecord]:
        return [w for w in self.registry.workers.values() if w.info.site == site and w.info.role == role.proto]

    def wanted(self, site: str, role: Role) -> int:
        """The pool's desired size: the router's, or (scaling: external) what the orchestrator runs."""
        if self.external:
            return sum(not w.draining for w in self._members(site, role))
        return self.desired[(site, role)]

    def status(self, site: str, role: Role) -> apb.PoolStatus:
        members = self._members(site, role)
        active = [w for w in members if not w.draining and self.registry.healthy(w)]
        return apb.PoolStatus(
            site=site, role=role, desired=self.wanted(site, role), active=len(active),
            draining=sum(w.draining for w in members),
            unhealthy=sum(not w.draining and not self.registry.healthy(w) for w in members),
            workers=sorted(w.info.worker_id for w in active))

    def check_pool(self, site: str, role: str) -> str | None:
        """None if (site, role) names a pool (``role`` as the API spells it), else what is wrong."""
        if role not in tuple(Role):
            return f"role must be prefill or decode, got {role!r}"
        if (site, Role(role)) not in self.desired:
            return f"unknown site {site!r} (sites: {', '.join(s.name for s in self.cfg.sites)})"
        return None

    def scale(self, site: str, role: Role, replicas: int) -> tuple[apb.PoolStatus, list[str]]:
        self.desired[(site, role)] = replicas
        return self.status(site, role), self.trim(site, role)

    def trim(self, site: str, role: Role) -> list[str]:
        """Drains the least busy active workers of a pool above its desired size
        (never with scaling: external)."""
        if self.external:
            return []
        active = [w for w in self._members(site, role) if not w.draining and self.registry.healthy(w)]
        excess = len(active) - self.desired[(site, role)]
        if excess <= 0:
            return []
        # least busy first; among equals the newest, whose caches hold least
        victims = sorted(active, key=lambda w: (w.inflight, -w.registered_at))[:excess]
        for w in victims:
            self.start_drain(w)
        return [w.info.worker_id for w in victims]

    def start_drain(self, w: WorkerRecord) -> None:
        if not w.draining:
            w.draining = True
            w.drain_since = time.monotonic()
            log.info("draining %s (%d requests on it)", w.info.worker_id, w.inflight)

    def drain(self, worker_id: str) -> apb.PoolStatus:
        w = self.registry.workers[worker_id]
        key = (w.info.site, Role.of(w.info.role))
        if not w.draining:
            if not self.external:  # else the orchestrator starts a replacement: a graceful restart
                self.desired[key] = max(0, self.desired[key] - 1)
            self.start_drain(w)
        return self.status(*key)

    def list(self) -> list[apb.PoolStatus]:
        return [self.status(site, role) for site, role in self.desired]

    def figures(self) -> builtins.list[PoolFigures]:
        """Each pool's recent figures, from finished requests and the workers' last heartbeats."""
        served = self.window.trim(time.monotonic())
        span = max(1.0, min(self.window.window_s, time.monotonic() - served[0].at)) if served else 1.0
        out = []
        for site, role in self.desired:
            desired = self.wanted(site, role)
            members = [w for w in self._members(site, role) if not w.draining and self.registry.healthy(w)]
            f = PoolFigures(site, role, desired, len(members), self.minimum[(site, role)],
                            self.limits[(site, role)])
            if role == Role.PREFILL:
                mine = [s for s in served if s.prefill_site == site and s.prefill_role == Role.PREFILL]
                rates = [w.load.prefill_tokens_per_s for w in members if w.load.prefill_tokens_per_s > 0]
                f.tokens_per_s_placed = sum(s.prompt_tokens for s in mine) / span
                f.tokens_per_s_per_worker = (sum(rates) / len(rates) if rates
                                             else self.cfg.router.placement.default_prefill_tokens_per_s)
                f.queued_tokens = sum(w.load.queued_prefill_tokens + w.pending_prefill_tokens for w in members)
                f.ttft_p90_s = p90([s.ttft_s for s in mine])
            else:
                mine = [s for s in served if s.decode_site == site]
                f.tpot_p90_s = p90([s.tpot_s for s in mine if s.tpot_s is not None])
                f.waiting = sum(w.load.waiting for w in members)
                usage = [1 - w.load.free_blocks / w.load.total_blocks for w in members if w.load.total_blocks]
                f.kv_usage = sum(usage) / len(usage) if usage else 0.0
            f.requests = len(mine)
            out.append(f)
        return out
