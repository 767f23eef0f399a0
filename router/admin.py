"""The operator API (``kvrelay.v1.Admin``), a thin gRPC adapter over the
pools (router/pools.py) and the planner (router/planner.py); every call needs
operator credentials: a token in ``auth.operators`` or an operator certificate."""

from __future__ import annotations

import logging

import grpc
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc

from router.errors import RouterError
from router.peer import STATUS, CallAuth
from router.planner import plan
from router.pools import PoolManager

log = logging.getLogger(__name__)


class AdminService(agrpc.AdminServicer):
    def __init__(self, pools: PoolManager, auth: CallAuth) -> None:
        self.auth = auth
        self.pools = pools

    async def _authorize(self, context: grpc.aio.ServicerContext) -> str:
        try:
            return self.auth.operator(context)
        except RouterError as exc:
            await context.abort(STATUS[exc.kind], exc.message)

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
