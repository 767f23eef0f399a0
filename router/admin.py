"""The operator API (``kvrelay.v1.Admin``): per-site pool sizes, draining,
and the operator credentials every call needs.

The router holds each pool's desired size; launchers (local processes or
Ray, ``cluster/launcher.py``) start workers until the pool has that many.
Scale-down is the router's choice of the least busy workers: it places
nothing more on them, and tells them over their heartbeat to leave once the
requests it has on them are finished (``drained``), or when
``router.drain_timeout_s`` has passed."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

import grpc
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import worker_pb2 as wpb

from router.planner import PoolFigures, RequestWindow, p90, plan
from router.registry import ROLE_NAMES, WorkerRecord, WorkerRegistry
from runtime.config import ClusterConfig, Credential

log = logging.getLogger(__name__)

ROLES = {"prefill": wpb.ROLE_PREFILL, "decode": wpb.ROLE_DECODE}


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class BearerAuth:
    """Checks ``authorization: Bearer <token>`` against configured credentials
    (``auth.operators`` for the Admin API, ``auth.clients`` for tenants)."""

    def __init__(self, credentials: list[Credential]) -> None:
        self.hashes = [(c.token_sha256, c.name) for c in credentials]

    @property
    def required(self) -> bool:
        """Credentials are configured, so callers must present one."""
        return bool(self.hashes)

    def who(self, metadata) -> str | None:
        """The credential's name, or None when it is missing or wrong."""
        value = dict(metadata or ()).get("authorization", "")
        if not value.startswith("Bearer "):
            return None
        digest = token_sha256(value[len("Bearer "):].strip())
        for want, name in self.hashes:
            if hmac.compare_digest(digest, want):
                return name
        return None

    async def require(self, context, kind: str, listed_in: str) -> str:
        """The caller's name; aborts the call with UNAUTHENTICATED when its
        ``kind`` ("operator", "client") credentials are missing or wrong."""
        who = self.who(context.invocation_metadata())
        if who is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{kind} credentials required: metadata 'authorization: Bearer <token>' with a "
                                f"token listed in {listed_in}")
        return who


class PoolManager:
    """Desired pool sizes and the draining of workers, over the registry."""

    def __init__(self, cfg: ClusterConfig, registry: WorkerRegistry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.desired: dict[tuple[str, str], int] = {}
        self.limits: dict[tuple[str, str], int] = {}
        self.minimum: dict[tuple[str, str], int] = {}
        for s in cfg.sites:
            for role in ROLES:
                pool = getattr(s, role)
                self.desired[(s.name, role)] = pool.replicas
                self.limits[(s.name, role)] = pool.max_replicas
                self.minimum[(s.name, role)] = pool.min_replicas
        self.window = RequestWindow(cfg.router.planner_window_s)
        """Recently finished requests: the planner's figures."""

    def _members(self, site: str, role: str) -> list[WorkerRecord]:
        return [w for w in self.registry.workers.values()
                if w.info.site == site and ROLE_NAMES.get(w.info.role) == role]

    def status(self, site: str, role: str) -> apb.PoolStatus:
        members = self._members(site, role)
        active = [w for w in members if not w.draining and self.registry.healthy(w)]
        return apb.PoolStatus(
            site=site, role=role, desired=self.desired[(site, role)], active=len(active),
            draining=sum(w.draining for w in members),
            unhealthy=sum(not w.draining and not self.registry.healthy(w) for w in members),
            workers=sorted(w.info.worker_id for w in active))

    def check_pool(self, site: str, role: str) -> str | None:
        """None if (site, role) names a pool, else what is wrong."""
        if role not in ROLES:
            return f"role must be prefill or decode, got {role!r}"
        if (site, role) not in self.desired:
            return f"unknown site {site!r} (sites: {', '.join(s.name for s in self.cfg.sites)})"
        return None

    def scale(self, site: str, role: str, replicas: int) -> tuple[apb.PoolStatus, list[str]]:
        self.desired[(site, role)] = replicas
        return self.status(site, role), self.trim(site, role)

    def trim(self, site: str, role: str) -> list[str]:
        """Drains the least busy active workers of a pool above its desired size."""
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
        key = (w.info.site, ROLE_NAMES[w.info.role])
        if not w.draining:
            self.desired[key] = max(0, self.desired[key] - 1)
            self.start_drain(w)
        return self.status(*key)

    def list(self) -> list[apb.PoolStatus]:
        return [self.status(site, role) for site, role in self.desired]

    def figures(self) -> list[PoolFigures]:
        """Each pool's recent figures, from finished requests and the workers' last heartbeats."""
        served = self.window.trim(time.monotonic())
        span = max(1.0, min(self.window.window_s, time.monotonic() - served[0].at)) if served else 1.0
        out = []
        for (site, role), desired in self.desired.items():
            members = [w for w in self._members(site, role) if not w.draining and self.registry.healthy(w)]
            f = PoolFigures(site, role, desired, len(members), self.minimum[(site, role)],
                            self.limits[(site, role)])
            if role == "prefill":
                mine = [s for s in served if s.prefill_site == site and s.prefill_role == "prefill"]
                rates = [w.load.prefill_tokens_per_s for w in members if w.load.prefill_tokens_per_s > 0]
                f.tokens_per_s_placed = sum(s.prompt_tokens for s in mine) / span
                f.tokens_per_s_per_worker = (sum(rates) / len(rates) if rates
                                             else self.cfg.router.default_prefill_tokens_per_s)
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


class AdminService(agrpc.AdminServicer):
    def __init__(self, cfg: ClusterConfig, pools: PoolManager) -> None:
        self.auth = BearerAuth(cfg.auth.operators)
        self.pools = pools

    async def _authorize(self, context: grpc.aio.ServicerContext) -> str:
        return await self.auth.require(context, "operator", "auth.operators (kvrelay: --token-file)")

    async def Scale(self, request: apb.ScaleRequest, context) -> apb.ScaleResponse:
        who = await self._authorize(context)
        problem = self.pools.check_pool(request.site, request.role)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        limit = self.pools.limits[(request.site, request.role)]
        if not 0 <= request.replicas <= limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"replicas must be in [0, {limit}] for {request.site}/{request.role} "
                                f"(max_replicas in the config), got {request.replicas}")
        pool, drained = self.pools.scale(request.site, request.role, request.replicas)
        log.info("%s scaled %s/%s to %d (draining: %s)", who, request.site, request.role, request.replicas,
                 ", ".join(drained) or "none")
        return apb.ScaleResponse(pool=pool, draining=drained)

    async def Drain(self, request: apb.DrainRequest, context) -> apb.DrainResponse:
        who = await self._authorize(context)
        if request.worker_id not in self.pools.registry.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {request.worker_id!r} is registered")
        log.info("%s drains %s", who, request.worker_id)
        return apb.DrainResponse(pool=self.pools.drain(request.worker_id))

    async def ListPools(self, request, context) -> apb.ListPoolsResponse:
        await self._authorize(context)
        return apb.ListPoolsResponse(pools=self.pools.list())

    async def Plan(self, request: apb.PlanRequest, context) -> apb.PlanResponse:
        who = await self._authorize(context)
        r = self.pools.cfg.router
        plans = plan(self.pools.figures(), r.slo_ttft_s, r.slo_tpot_s)
        if request.apply:
            for p in plans:
                if p.recommended != p.current:
                    self.pools.scale(p.site, p.role, p.recommended)
                    log.info("%s applied the plan: %s/%s %d -> %d (%s)", who, p.site, p.role, p.current,
                             p.recommended, "; ".join(p.reasons))
        return apb.PlanResponse(plans=[apb.PoolPlan(site=p.site, role=p.role, current=p.current,
                                                    recommended=p.recommended, reasons=p.reasons) for p in plans],
                                window_s=self.pools.window.window_s, applied=request.apply)
