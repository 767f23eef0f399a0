"""The operator API (``kvrelay.v1.Admin``), a thin gRPC adapter over the
pools (router/cluster/pools.py) and the planner (router/cluster/planner.py); every call needs
operator credentials: a token in ``auth.operators`` or an operator certificate, but for Usage and
Governance, which a tenant's own credentials read too, limited to that tenant."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import grpc

from kvrelay.router.cluster.planner import plan
from kvrelay.router.cluster.pools import PoolManager
from kvrelay.router.cluster.usage import grouping, usage_response
from kvrelay.router.core.errors import RouterError
from kvrelay.router.core.records import Auditor, RecordKind
from kvrelay.router.frontends.peer import STATUS, GrpcCaller, authorization
from kvrelay.router.governance.statement import UnknownTenant, deployment_state, statement
from kvrelay.runtime.roles import Role
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc

if TYPE_CHECKING:
    from kvrelay.router.core.pipeline import RouterCore

log = logging.getLogger(__name__)

_READS = {"usage": "usage", "governance": "data-handling statement"}
"""What a tenant may read of its own through the Admin API, by audit action."""


def external_scaling_hint(request: apb.ScaleRequest) -> str:
    """Why Scale is refused under ``router.pools.scaling: external``, and what to change instead."""
    return (f"pool sizes are set by the orchestrator here (router.pools.scaling: external), not by the router: "
            f"scale {request.site}/{request.role} with the Helm chart (sites[].{request.role}.replicas of "
            f"site {request.site}, then helm upgrade) or kubectl scale deployment of that pool; "
            "the router takes every worker that registers")


class AdminService(agrpc.AdminServicer):
    def __init__(self, core: RouterCore, auth: GrpcCaller, audit: Auditor | None) -> None:
        """``audit``: where operator actions are recorded (None: nowhere)."""
        self.auth = auth
        self.core = core
        self.audit = audit
        self.pools: PoolManager = core.pools
        self.usage = core.usage
        self.membership = core.membership

    def _audit(self, who: str, action: str, **fields) -> None:
        """One audit record of an operator action (router/governance/audit.py; none when there is no audit log)."""
        if self.audit is not None:
            self.audit.append(RecordKind.OPERATOR, {"operator": who, "action": action, **fields})

    async def _authorize(self, context: grpc.aio.ServicerContext) -> str:
        try:
            return await self.auth.operator(context)
        except RouterError as exc:
            self.core.audit_refused("admin", exc, "token" if authorization(context) else "none")
            await context.abort(STATUS[exc.kind], exc.message)

    async def Scale(self, request: apb.ScaleRequest, context) -> apb.ScaleResponse:
        who = await self._authorize(context)
        problem = self.pools.check_pool(request.site, request.role)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if self.pools.external:
            self._audit(who, "scale", site=request.site, role=request.role, replicas=request.replicas,
                        outcome="refused: router.pools.scaling is external")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, external_scaling_hint(request))
        role = Role(request.role)
        limit = self.pools.limits[(request.site, role)]
        if not 0 <= request.replicas <= limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"replicas must be in [0, {limit}] for {request.site}/{role} "
                                f"(max_replicas in the config), got {request.replicas}")
        await self._shared_pools(context)
        pool, drained = self.pools.scale(request.site, role, request.replicas)
        await self._publish(request.site, role, drained)
        self._audit(who, "scale", site=request.site, role=request.role, replicas=request.replicas,
                    draining=list(drained))
        log.info("%s scaled %s/%s to %d (draining: %s)", who, request.site, request.role, request.replicas,
                 ", ".join(drained) or "none")
        return apb.ScaleResponse(pool=pool, draining=drained)

    async def Drain(self, request: apb.DrainRequest, context) -> apb.DrainResponse:
        who = await self._authorize(context)
        if request.worker_id not in self.pools.registry.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {request.worker_id!r} is registered")
        await self._shared_pools(context)
        log.info("%s drains %s", who, request.worker_id)
        self._audit(who, "drain", worker=request.worker_id, site=request.worker_id.partition("/")[0])
        pool = self.pools.drain(request.worker_id)
        await self._publish(pool.site, Role(pool.role), [request.worker_id])
        return apb.DrainResponse(pool=pool)

    async def _shared_pools(self, context) -> None:
        """UNAVAILABLE when this router could not share a pool change with the others (etcd away)."""
        problem = self.membership.can_change_pools()
        if problem is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, problem)

    async def _publish(self, site: str, role: Role, drained: list[str]) -> None:
        """A pool change, for the other routers (router/cluster/membership.py)."""
        await self.membership.publish_pool(site, role, self.pools.desired[(site, role)], drained)

    async def ListPools(self, request, context) -> apb.ListPoolsResponse:
        await self._authorize(context)
        return apb.ListPoolsResponse(pools=self.pools.list())

    async def Plan(self, request: apb.PlanRequest, context) -> apb.PlanResponse:
        who = await self._authorize(context)
        r = self.pools.cfg.router
        plans = plan(self.pools.figures(), r.pools.slo_ttft_s, r.pools.slo_tpot_s)
        if request.apply:
            await self._shared_pools(context)
            for p in plans:
                if p.recommended != p.current:
                    _, drained = self.pools.scale(p.site, p.role, p.recommended)
                    await self._publish(p.site, p.role, drained)
                    self._audit(who, "plan apply", site=p.site, role=p.role, replicas=p.recommended,
                                previous=p.current, reasons=list(p.reasons))
                    log.info("%s applied the plan: %s/%s %d -> %d (%s)", who, p.site, p.role, p.current,
                             p.recommended, "; ".join(p.reasons))
        return apb.PlanResponse(plans=[apb.PoolPlan(site=p.site, role=p.role, current=p.current,
                                                    recommended=p.recommended, reasons=p.reasons) for p in plans],
                                window_s=self.pools.window.window_s, applied=request.apply)

    async def _reader(self, context: grpc.aio.ServicerContext, asked: str, action: str) -> tuple[str, str | None]:
        """The tenant whose usage or statement the call reads ("" = every tenant's, for an
        operator), and the operator calling (None: a tenant reading its own, audited here as a
        ``read`` record). PERMISSION_DENIED when a tenant asks for another tenant's."""
        try:
            who, own = await self.auth.reader(context)
        except RouterError as exc:
            self.core.audit_refused("admin", exc, "token" if authorization(context) else "none")
            await context.abort(STATUS[exc.kind], exc.message)
        if own is None:
            return asked, who
        if asked and asked != own:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"tenant {own!r} reads its own {_READS[action]} only, not tenant {asked[:64]!r}'s")
        if self.audit is not None:
            self.audit.append(RecordKind.READ, {"tenant": own, "action": action})
        return own, None

    async def Governance(self, request: apb.GovernanceRequest, context) -> apb.GovernanceResponse:
        """The data-handling statement (router/governance/statement.py) of one tenant or all, from the live
        state; a tenant reads its own (without the list of live workers)."""
        tenant, who = await self._reader(context, request.tenant, "governance")
        if who is not None:
            self._audit(who, "governance", tenant=request.tenant[:64] or None)
        state = deployment_state(self.pools.registry, self.pools.desired)
        try:
            doc = statement(self.pools.cfg, state, tenant or None)
        except UnknownTenant as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        if who is None:  # a tenant: its own statement, without the live workers
            doc["deployment"].pop("workers", None)
        return apb.GovernanceResponse(statement_json=json.dumps(doc))

    async def Usage(self, request: apb.UsageRequest, context) -> apb.UsageResponse:
        """Usage totals per group from the workers' own counters (router/cluster/usage.py), a tenant's
        own only for a tenant; INVALID_ARGUMENT naming a group-by that is not one of tenant, site, link,
        role, worker."""
        tenant, who = await self._reader(context, request.tenant, "usage")
        if who is not None:
            self._audit(who, "usage", tenant=request.tenant[:64] or None)
        try:
            by = grouping(request.by)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        report = await self.usage.report(request.since_unix, by, tenant)
        return usage_response(report)
