"""The worker Registry (``kvrelay.v1.Registry``): workers register, heartbeat
their load, prefix-cache events and link probes, and leave; ``ListWorkers``
is what ``kvrelay status`` shows. A thin gRPC adapter over
router/cluster/registry.py and router/cluster/pools.py; the usage counters of heartbeats
(and of a leaving worker's Deregister) go to the ledger (router/cluster/usage.py).

Who may call what (with TLS on; these calls come over the mutual-TLS
listener): ``Register`` only with a prefill or decode certificate naming
exactly the worker id, site and role it registers, and never for an id a
live worker holds; ``Heartbeat`` and ``Deregister`` only for the caller's
own id; ``ListWorkers`` only for operators (token or certificate). Nothing
changes in the registry for a call that is refused."""

from __future__ import annotations

import logging
import time

import grpc

from kvrelay.router.cluster.registry import worker_problem
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.pipeline import RouterCore
from kvrelay.router.core.records import Auditor, RecordKind
from kvrelay.router.frontends.peer import STATUS, GrpcCaller
from kvrelay.runtime.config import LinkSection
from kvrelay.runtime.etcd import EtcdError
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.runtime.roles import Role
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class RegistryService(wgrpc.RegistryServicer):
    def __init__(self, core: RouterCore, auth: GrpcCaller, audit: Auditor | None) -> None:
        """``audit``: where registrations (and refused ones) are recorded (None: nowhere)."""
        self.core = core
        self.registry = core.registry
        self.pools = core.pools
        self.topology = core.topology
        self.cfg = core.cfg
        self.telemetry = core.telemetry
        self.policy = core.policy
        self.auth = auth
        self.audit = audit

    def _own(self, context, worker_id: str, what: str) -> None:
        """RouterError unless the caller's certificate is worker ``worker_id``'s (TLS off: no check)."""
        if self.auth.tls is None:
            return
        cert = self.auth.cert(context)
        if cert is None or cert.role not in (CertRole.PREFILL, CertRole.DECODE):
            raise RouterError(ErrorKind.UNAUTHENTICATED if cert is None else ErrorKind.PERMISSION_DENIED,
                              f"{what} needs a prefill or decode worker certificate from the cluster CA "
                              f"(mutual TLS, the router's internal port); got {cert or 'none'}")
        if cert.path != worker_id:
            raise RouterError(ErrorKind.PERMISSION_DENIED,
                              f"{what} for {worker_id!r} refused: the caller's certificate is for {cert.path!r}")

    def _check_register(self, info: wpb.WorkerInfo, context) -> Role:
        problem = worker_problem(info, self.topology.jurisdiction)
        if problem is not None:
            raise RouterError(ErrorKind.INVALID, problem)
        role = Role.of(info.role)
        self._own(context, info.worker_id, "Register")
        holder = self.registry.holder(info.worker_id)
        if holder is not None and holder.info.address != info.address:
            age = time.monotonic() - holder.last_seen
            raise RouterError(ErrorKind.ALREADY_EXISTS,
                              f"worker {info.worker_id} is registered and alive at {holder.info.address} (last "
                              f"heartbeat {age:.1f} s ago); a second registration cannot take it over")
        return role

    async def Register(self, request: wpb.RegisterRequest, context) -> wpb.RegisterResponse:
        info = request.info
        try:
            role = self._check_register(info, context)
        except RouterError as exc:
            log.warning("refused to register %s from %s: %s", info.worker_id, context.peer(), exc.message)
            self._audit(info, context, exc.kind.value)
            await context.abort(STATUS[exc.kind], exc.message)
        try:  # the other routers learn it from etcd; without etcd, no router may take on new workers
            await self.core.membership.publish_worker(info)
        except EtcdError as exc:
            log.warning("refused to register %s: %s", info.worker_id, exc)
            self._audit(info, context, "unavailable: the routers' shared store is unreachable")
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"cannot register {info.worker_id} now: the routers' shared store is unreachable "
                                f"({exc}); the routers serve their known workers and take new ones when it is back")
        self._audit(info, context, "ok")
        await self.registry.register(info)
        log.info("worker %s registered at %s", info.worker_id, info.address)
        drained = self.pools.trim(info.site, role)  # a pool scaled down while this worker was starting
        if drained:
            log.info("%s/%s is above its desired size: draining %s", info.site, role, ", ".join(drained))
            await self.core.membership.publish_pool(info.site, role, self.pools.desired[(info.site, role)], drained)
        return wpb.RegisterResponse(heartbeat_interval_s=self.cfg.router.liveness.heartbeat_interval_s,
                                    routers=self._peers())

    def _audit(self, info: wpb.WorkerInfo, context, outcome: str) -> None:
        """A registration and the certificate it came with, accepted or refused, in the audit log."""
        if self.audit is None:
            return
        cert: Identity | str | None
        try:
            cert = self.auth.cert(context) if self.auth.tls is not None else None
        except RouterError as exc:
            cert = f"refused: {exc.message}"
        self.audit.append(RecordKind.REGISTRATION, {
            "worker": info.worker_id[:200], "site": info.site[:64], "address": info.address[:200],
            "certificate": str(cert) if cert is not None else "none (TLS off)", "outcome": outcome})

    async def _refuse_unless_own(self, context, worker_id: str, what: str) -> None:
        try:
            self._own(context, worker_id, what)
        except RouterError as exc:
            await context.abort(STATUS[exc.kind], exc.message)

    async def Heartbeat(self, request: wpb.HeartbeatRequest, context) -> wpb.HeartbeatResponse:
        await self._refuse_unless_own(context, request.load.worker_id, "Heartbeat")
        resp = self.registry.heartbeat(request)
        resp.routers.extend(self._peers())
        return resp

    def _peers(self) -> list:
        """The live routers, for a worker's answer: with several (``routers:``) only; one router has none to add."""
        return self.core.membership.peers() if self.cfg.routers else []

    async def Deregister(self, request: wpb.DeregisterRequest, context) -> wpb.DeregisterResponse:
        await self._refuse_unless_own(context, request.worker_id, "Deregister")
        final = request.load if request.HasField("load") else None  # its last usage counters
        if await self.registry.deregister(request.worker_id, final):
            log.info("worker %s left", request.worker_id)
        await self.core.membership.forget_worker(request.worker_id)
        return wpb.DeregisterResponse()

    def _link_status(self, lc: LinkSection, now: float) -> wpb.LinkStatus:
        topo, reg = self.core.topology, self.registry
        if not lc.between:
            out = wpb.LinkStatus(name=reg.local_link.name, up=True)
        else:
            key = frozenset(lc.between)
            health = reg.link_health[key]
            out = wpb.LinkStatus(name=reg.links[key].name, up=reg.links[key].up, down_reason=health.reason,
                                 changed_s_ago=now - health.changed_at if health.changed_at else 0.0)
        out.transport, out.protection, out.kv_codec = topo.transport(lc), topo.protection(lc), str(lc.kv_codec)
        self._measured(out, now)
        return out

    def _measured(self, out: wpb.LinkStatus, now: float) -> None:
        """``out``'s configured and measured figures (router/placement/link_estimate.py)."""
        fig = self.registry.meter.status(out.name)
        if fig is None:
            return
        est = fig.estimate
        out.gbps, out.rtt_ms, out.rate_source, out.placement_gbps = (fig.configured_gbps, fig.configured_rtt_ms,
                                                                      fig.source.value, fig.gbps)
        if now - est.last_at <= self.cfg.router.placement.link_rates.max_age_s:
            out.measured_gbps, out.measured_floor_gbps, out.measured_rtt_ms = est.gbps, est.floor_gbps, est.rtt_ms
            out.rate_samples, out.measured_s_ago = est.samples, now - est.last_at

    async def ListWorkers(self, request, context) -> wpb.ListWorkersResponse:
        try:
            await self.auth.operator(context)
        except RouterError as exc:
            await context.abort(STATUS[exc.kind], exc.message)
        now = time.monotonic()
        reg, cfg = self.registry, self.cfg
        links = [self._link_status(lc, now) for lc in [cfg.local_link, *cfg.links]]
        rates = self.telemetry.link_rates.per_s()
        for lk in links:
            lk.kv_bytes_per_s = rates.get(lk.name, 0.0)
        return wpb.ListWorkersResponse(workers=[
            wpb.WorkerStatus(info=w.info, load=w.load, healthy=reg.healthy(w), last_heartbeat_age_s=now - w.last_seen,
                             draining=w.draining, inflight=w.inflight,
                             cached_blocks=reg.index.blocks_of(w.info.worker_id))
            for w in sorted(reg.workers.values(), key=lambda w: w.info.worker_id)], links=links,
            policy=self.policy.name, latency=self.telemetry.latency(),
            router_metrics_address=self.core.metrics_address, storage=self.core.disk.describe(),
            routers=self.core.membership.peers(), router_name=self.core.membership.me.name,
            coordination=self.core.membership.coordination())
