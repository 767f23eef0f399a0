"""The worker Registry (``kvrelay.v1.Registry``): workers register, heartbeat
their load, prefix-cache events and link probes, and leave; ``ListWorkers``
is what ``kvrelay status`` shows. A thin gRPC adapter over
router/registry.py and router/pools.py."""

from __future__ import annotations

import logging
import time

import grpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

from router.core import RouterCore
from runtime.config import LinkSection
from runtime.topology import Role

log = logging.getLogger(__name__)


class RegistryService(wgrpc.RegistryServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.registry = core.registry

    async def Register(self, request: wpb.RegisterRequest, context) -> wpb.RegisterResponse:
        info = request.info
        if info.site not in self.core.topology.jurisdiction:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown site {info.site!r}")
        try:
            role = Role.of(info.role)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be prefill or decode")
        await self.registry.register(info)
        log.info("worker %s registered at %s", info.worker_id, info.address)
        drained = self.core.pools.trim(info.site, role)  # a pool scaled down while this worker was starting
        if drained:
            log.info("%s/%s is above its desired size: draining %s", info.site, role, ", ".join(drained))
        return wpb.RegisterResponse(heartbeat_interval_s=self.core.cfg.router.heartbeat_interval_s)

    async def Heartbeat(self, request: wpb.HeartbeatRequest, context) -> wpb.HeartbeatResponse:
        return self.registry.heartbeat(request)

    async def Deregister(self, request: wpb.DeregisterRequest, context) -> wpb.DeregisterResponse:
        if await self.registry.deregister(request.worker_id):
            log.info("worker %s left", request.worker_id)
        return wpb.DeregisterResponse()

    def _link_status(self, lc: LinkSection, now: float) -> wpb.LinkStatus:
        topo, reg = self.core.topology, self.registry
        if not lc.between:
            lv = reg.local_link
            return wpb.LinkStatus(name=lv.name, rtt_ms=lv.rtt_ms, gbps=lv.gbps, up=True,
                                  transport=topo.transport(lc), encrypt=topo.encrypts(lc))
        key = frozenset(lc.between)
        lv, health = reg.links[key], reg.link_health[key]
        return wpb.LinkStatus(name=lv.name, rtt_ms=lv.rtt_ms, gbps=lv.gbps, up=lv.up, transport=topo.transport(lc),
                              encrypt=topo.encrypts(lc), down_reason=health.reason,
                              changed_s_ago=now - health.changed_at if health.changed_at else 0.0)

    async def ListWorkers(self, request, context) -> wpb.ListWorkersResponse:
        now = time.monotonic()
        reg, cfg = self.registry, self.core.cfg
        links = [self._link_status(lc, now) for lc in [cfg.local_link, *cfg.links]]
        return wpb.ListWorkersResponse(workers=[
            wpb.WorkerStatus(info=w.info, load=w.load, healthy=reg.healthy(w), last_heartbeat_age_s=now - w.last_seen,
                             draining=w.draining, inflight=w.inflight,
                             cached_blocks=reg.index.blocks_of(w.info.worker_id))
            for w in sorted(reg.workers.values(), key=lambda w: w.info.worker_id)], links=links,
            policy=self.core.policy.name)
