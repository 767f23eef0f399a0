"""The router's view of its workers: registration, heartbeats with load and
prefix-cache events, health (a worker silent for ``timeout_s`` is
unhealthy), draining, gRPC stubs, and the snapshot placement decides on."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvrelay.router.placement.link_estimate import LinkMeter, LinkState
from kvrelay.router.placement.place import ClusterView, LinkView, WorkerView
from kvrelay.router.placement.prefix_index import PrefixIndex
from kvrelay.runtime.config import ClusterConfig
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.runtime.roles import Role
from kvrelay.runtime.rpc import PLAINTEXT, Dialer
from kvrelay.runtime.topology import LOCAL_LINK, Topology, link_name
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class _Mirrored:
    """A WorkerRecord attribute kept in ``slot`` and written through to its
    view row's ``column`` (when it has a row)."""

    __slots__ = ("column", "slot")

    def __init__(self, slot: str, column: str) -> None:
        self.slot, self.column = slot, column

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj, value) -> None:
        setattr(obj, self.slot, value)
        if obj.row is not None:
            setattr(obj.row, self.column, value)


RETIRED_GRACE_S = 900.0
"""How long a channel replaced by :meth:`WorkerRegistry.redial` waits for its calls (a decode
stream's longest life, with room) before it cancels the rest."""


@dataclass(slots=True)
class WorkerRecord:
    info: wpb.WorkerInfo
    load: wpb.WorkerLoad
    _last_seen: float
    channel: grpc.aio.Channel
    stub: wgrpc.PrefillWorkerStub | wgrpc.DecodeWorkerStub
    """By its role (:attr:`prefill_stub`, :attr:`decode_stub`)."""
    _draining: bool = False
    _inflight: int = 0
    synced: bool = False
    """The prefix index holds this worker's cache (a snapshot arrived)."""
    _pending: int = 0
    _since: int = 0
    """Prompt tokens this router sent here less those that came back prefilled since the last
    heartbeat: placement sees the heartbeat's queue plus this, so its own changes count at once in
    both directions (a prompt prefilled is not counted until the next heartbeat says so)."""
    registered_at: float = 0.0
    answered_at: float = 0.0
    """When the router last answered this worker's heartbeat (or registration):
    the probes in its next heartbeat started after this."""
    drain_since: float = 0.0
    """When draining started (monotonic); the worker leaves by drain_timeout_s after it."""
    row: WorkerView | None = None
    """Its row in the registry's placement view (written through on every change)."""

    last_seen = _Mirrored("_last_seen", "heard_at")
    """When it last heartbeated (monotonic); its view row's health clock."""
    draining = _Mirrored("_draining", "draining")
    inflight = _Mirrored("_inflight", "inflight")
    """Requests the router has on this worker now (exact, unlike heartbeats)."""

    @property
    def prefill_stub(self) -> wgrpc.PrefillWorkerStub:
        if not isinstance(self.stub, wgrpc.PrefillWorkerStub):
            raise RuntimeError(f"worker {self.info.worker_id} is not a prefill worker")
        return self.stub

    @property
    def decode_stub(self) -> wgrpc.DecodeWorkerStub:
        if not isinstance(self.stub, wgrpc.DecodeWorkerStub):
            raise RuntimeError(f"worker {self.info.worker_id} is not a decode worker")
        return self.stub

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens the router sent here whose first token has not come back."""
        return self._pending

    @pending_prefill_tokens.setter
    def pending_prefill_tokens(self, value: int) -> None:
        self._since += value - self._pending
        self._pending = value
        if self.row is not None:
            self.row.queued_prefill_tokens = max(0, self.load.queued_prefill_tokens + self._since)

    def heard(self, load: wpb.WorkerLoad) -> None:
        """A heartbeat's load: its queue holds this router's prompts sent before it (``_since`` starts over)."""
        self.load, self._since = load, 0
        self.sync_load()

    def sync_load(self) -> None:
        """Writes the last heartbeat's load into its view row."""
        if self.row is not None:
            load, r = self.load, self.row
            r.queued_prefill_tokens = max(0, load.queued_prefill_tokens + self._since)
            r.running, r.waiting = load.running, load.waiting
            r.free_blocks = load.free_blocks if load.total_blocks else (self.info.num_blocks or 1 << 30)
            r.prefill_tokens_per_s, r.decode_step_s = load.prefill_tokens_per_s, load.decode_step_ms / 1e3
            r.heard_at = self._last_seen


@dataclass(slots=True)
class LinkHealth:
    """What the workers' probes say about one link between two sites."""

    changed_at: float = 0.0
    """When it last went down or up (monotonic; 0 = never)."""
    reason: str = ""
    """Why it is down: which worker could not reach which site."""
    down: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the link goes down; a fresh one replaces it when it comes back,
    so requests moving KV across it can wait on it."""


def worker_identity(info: wpb.WorkerInfo) -> Identity | None:
    """The certificate identity ``info`` claims (``site/role/name`` as its
    worker id); None when the id does not spell its own site and role."""
    site, _, rest = info.worker_id.partition("/")
    role, _, name = rest.partition("/")
    try:
        ident = Identity(site, CertRole(role), name)
    except ValueError:
        return None
    if site != info.site or ident.role.value != Role.of(info.role).value:
        return None
    return ident


def worker_problem(info: wpb.WorkerInfo, sites: Iterable[str]) -> str | None:
    """Why ``info`` may not be registered (None: it may): Register's checks, which the routers apply
    to a worker learned from etcd too (router/cluster/shared_values.py). Its site and role must be those
    its worker id spells, the certificate identity every channel to it is pinned to."""
    if info.site not in sites:
        return f"unknown site {info.site[:80]!r}"
    try:
        role = Role.of(info.role)
    except ValueError:
        return "role must be prefill or decode"
    if worker_identity(info) is None:
        return (f"worker id {info.worker_id[:200]!r} must be <site>/<role>/<name> with site {info.site!r} and "
                f"role {role}")
    return None


LoadSink = Callable[[str, str, Role, wpb.WorkerLoad], None]
"""(worker id, site, role, load): what a worker reported (the usage ledger's ``observe``)."""


class WorkerRegistry:
    def __init__(self, cfg: ClusterConfig, dialer: Dialer = PLAINTEXT, on_load: LoadSink | None = None) -> None:
        """``dialer``: how the router connects to workers (its certificate); ``on_load``: where each
        worker's reported load (its usage counters) goes, from heartbeats and a leaving worker's last."""
        self.cfg = cfg
        self.dialer = dialer
        self._retired: set[asyncio.Task] = set()
        """Closings of channels :meth:`redial` replaced."""
        self.timeout_s = cfg.router.liveness.worker_timeout_s
        self.workers: dict[str, WorkerRecord] = {}
        self.index = PrefixIndex()
        self.on_load = on_load
        self.jurisdiction = {s.name: s.jurisdiction for s in cfg.sites}
        self.dedicated = {(s.name, role): frozenset(s.pool(role).tenants)
                          for s in cfg.sites for role in Role if s.pool(role).tenants}
        """(site, role) -> the tenants a dedicated pool serves (shared pools are absent)."""
        topo = Topology(cfg)
        self.links: dict[frozenset, LinkView] = {
            frozenset(link.between): LinkView(link.rtt_ms, link.gbps, True, link_name(*link.between),
                                              topo.kv_fraction(link))
            for link in cfg.links}
        ll = cfg.local_link
        self.local_link = LinkView(ll.rtt_ms, ll.gbps, True, LOCAL_LINK, topo.kv_fraction(ll))
        self.link_health = {key: LinkHealth() for key in self.links}
        self.meter = LinkMeter([*self.links.values(), self.local_link], cfg.router.placement.link_rates)
        """The links' figures measured from their transfers (written into the LinkViews above)."""
        self._metered_at = 0.0
        self._view: ClusterView | None = None
        self._members = 0
        """Bumped whenever a worker comes or goes (the view is rebuilt then)."""
        self._view_members = -1
        """The placement view (router/placement/views.py), rebuilt only when the set of workers changes."""
        self._beats = 0
        self._probe_pool: tuple[float, dict[str, list[WorkerRecord]]] = (-1e9, {})
        """Healthy workers per site, sorted, as probe targets (rebuilt at most every half interval:
        every heartbeat asks, so not once per heartbeat over every worker)."""


    def link_states(self) -> list[LinkState]:
        """Each configured link between sites (up now or not) and the local link: the rate placement uses (for
        /metrics)."""
        ll = self.local_link
        return [*(LinkState(lv.name, lv.up, lv.gbps, self.meter.source(lv.name).value) for lv in self.links.values()),
                LinkState(ll.name, True, ll.gbps, self.meter.source(ll.name).value, probed=False)]
    def pools_of(self, tenant: str) -> frozenset:
        """The dedicated pools ``tenant`` may use: requests with the same set (and
        constraints) fit the same workers, whoever their tenant."""
        return frozenset(pool for pool, tenants in self.dedicated.items() if tenant in tenants)

    def holder(self, worker_id: str) -> WorkerRecord | None:
        """The live worker that holds ``worker_id`` (heartbeating within the
        timeout), which no second registration may take over."""
        rec = self.workers.get(worker_id)
        return rec if rec is not None and self.healthy(rec) else None

    async def learn(self, info: wpb.WorkerInfo) -> None:
        """A worker another router registered (router/cluster/membership.py): dialled here too,
        but healthy only once its own heartbeat arrives here."""
        rec = self.workers.get(info.worker_id)
        if rec is None or rec.info != info:
            await self.register(info, heard=False)

    async def register(self, info: wpb.WorkerInfo, heard: bool = True) -> None:
        """Records a worker (replacing a silent record of the same id); the
        channel to it accepts only the certificate of exactly this worker.
        ``heard``: it registered here (healthy now); else unhealthy until it heartbeats."""
        old = self.workers.pop(info.worker_id, None)
        self._members += 1
        if old is not None:
            await old.channel.close()
        self.index.remove_worker(info.worker_id)
        channel, stub = self._dial(info)
        now = time.monotonic()
        seen = now if heard else now - self.timeout_s - 1.0
        self.workers[info.worker_id] = WorkerRecord(info, wpb.WorkerLoad(worker_id=info.worker_id),
                                                    seen, channel, stub, registered_at=now, answered_at=now)
        self._members += 1

    async def deregister(self, worker_id: str, load: wpb.WorkerLoad | None = None) -> bool:
        """Forgets a worker that is leaving, after taking its final ``load``
        (usage counters); False if it was not registered."""
        rec = self.workers.pop(worker_id, None)
        if rec is None:
            return False
        self._members += 1
        if load is not None and load.worker_id in ("", worker_id):
            self._observe_usage(rec, load)
        self.index.remove_worker(worker_id)
        await rec.channel.close()
        return True

    def heartbeat(self, req: wpb.HeartbeatRequest) -> wpb.HeartbeatResponse:
        rec = self.workers.get(req.load.worker_id)
        if rec is None:
            return wpb.HeartbeatResponse(known=False)
        rec.heard(req.load)
        rec.last_seen = time.monotonic()
        if rec.last_seen - self._metered_at >= 1.0:  # links measured long ago go back to their config
            self._metered_at = rec.last_seen
            self.meter.refresh(rec.last_seen)
        self._observe_usage(rec, req.load)
        ev = req.kv_events
        if ev.snapshot:
            rec.synced = True
        if rec.synced:
            self.index.apply(rec.info.worker_id, ev.stored, ev.removed, ev.snapshot)
        self._link_reports(rec, req.links, started_after=rec.answered_at)
        rec.answered_at = time.monotonic()
        drained = rec.draining and (rec.inflight == 0 or
                                    rec.last_seen - rec.drain_since > self.cfg.router.pools.drain_timeout_s)
        return wpb.HeartbeatResponse(known=True, send_snapshot=not rec.synced, drain=rec.draining, drained=drained,
                                     probes=self.probe_targets(rec),
                                     probe_timeout_s=self.cfg.router.liveness.link_probe_timeout_s)

    def probe_targets(self, rec: WorkerRecord) -> list[wpb.ProbeTarget]:
        """One healthy worker in each site linked to ``rec``'s, for it to probe
        before its next heartbeat (rotating, so one bad host cannot pin a link down)."""
        self._beats += 1
        site, out = rec.info.site, []
        spread = zlib.crc32(rec.info.worker_id.encode())
        by_site = self._healthy_by_site()
        for key in self.links:
            if site not in key:
                continue
            (other,) = key - {site}
            there = by_site.get(other)
            if there:
                pick = there[(self._beats + spread) % len(there)]
                out.append(wpb.ProbeTarget(site=other, address=pick.info.address))
        return out

    def _healthy_by_site(self) -> dict[str, list[WorkerRecord]]:
        now = time.monotonic()
        built, by_site = self._probe_pool
        if now - built > self.cfg.router.liveness.heartbeat_interval_s / 2:
            by_site = {}
            for w in sorted(self.workers.values(), key=lambda w: w.info.worker_id):
                if self.healthy(w):
                    by_site.setdefault(w.info.site, []).append(w)
            self._probe_pool = (now, by_site)
        return by_site

    def _link_reports(self, rec: WorkerRecord, reports, started_after: float) -> None:
        """Marks links down or up from a worker's probe results: the latest report
        decides, among probes that started after the link's last change (a probe
        still running when the link changed says nothing about its new state)."""
        for r in reports:
            key = frozenset((rec.info.site, r.site))
            lv = self.links.get(key)
            if lv is None or lv.up == r.reachable:
                continue
            health = self.link_health[key]
            if started_after < health.changed_at:
                continue
            health.changed_at = time.monotonic()
            lv.up = r.reachable
            if r.reachable:
                health.reason = ""
                health.down = asyncio.Event()
                log.warning("link %s is up again (%s reached %s in %.1f ms)", lv.name, rec.info.worker_id,
                            r.site, r.connect_ms)
            else:
                health.reason = f"{rec.info.worker_id} could not reach {r.site}: {r.error}"
                health.down.set()
                log.warning("link %s is down: %s; placement avoids it", lv.name, health.reason)

    def link_view(self, a: str, b: str) -> LinkView | None:
        """The link between sites ``a`` and ``b`` as placement sees it (its figures in use), up or down."""
        return self.local_link if a == b else self.links.get(frozenset((a, b)))

    def link_down_event(self, a: str, b: str) -> asyncio.Event | None:
        """Set if the link between sites ``a`` and ``b`` goes down (None within a site)."""
        health = self.link_health.get(frozenset((a, b))) if a != b else None
        return None if health is None else health.down

    def suspect(self, worker_id: str) -> None:
        """A call to this worker just failed: unhealthy until its next heartbeat."""
        rec = self.workers.get(worker_id)
        if rec is not None:
            rec.last_seen = min(rec.last_seen, time.monotonic() - self.timeout_s - 1.0)

    def healthy(self, rec: WorkerRecord) -> bool:
        return time.monotonic() - rec.last_seen <= self.timeout_s

    def candidates(self, role: Role) -> list[WorkerRecord]:
        """Healthy, non-draining workers of ``role``."""
        return [w for w in self.workers.values()
                if w.info.role == role.proto and not w.draining and self.healthy(w)]

    def view(self) -> ClusterView:
        """The snapshot placement decides on: one view kept across decisions
        (rebuilt when workers come or go), its rows written as loads, requests
        in flight, heartbeats and draining change; health is refreshed here
        from the heartbeat clock column (one vector operation)."""
        if self._view is None or self._view_members != self._members:
            self._view = self._build_view(list(self.workers.values()))
            self._view_members = self._members
        cols = self._view.table.cols
        np.less_equal(time.monotonic() - cols.heard_at, self.timeout_s, out=cols.healthy)
        return self._view

    def _build_view(self, recs: list[WorkerRecord]) -> ClusterView:
        r = self.cfg.router
        workers = []
        kv_block_bytes, num_layers = 0, 1
        for rec in recs:
            info = rec.info
            if info.kv_block_bytes:
                kv_block_bytes, num_layers = info.kv_block_bytes, max(1, info.num_layers)
            workers.append(WorkerView(info.worker_id, Role.of(info.role), info.site, True, rec.draining,
                                      rec.inflight, r.admission.max_inflight_per_worker,
                                      tenants=self.dedicated.get((info.site, Role.of(info.role)), frozenset()),
                                      layout=info.layout_hash,
                                      block_size=_own_block_size(info.block_size, self.cfg.cache.block_size)))
        view = ClusterView(workers, self.jurisdiction, self.links, self.local_link,
                           block_size=self.cfg.cache.block_size, kv_block_bytes=kv_block_bytes,
                           num_layers=num_layers, default_prefill_tokens_per_s=r.placement.default_prefill_tokens_per_s,
                           colocate_below_tokens=r.placement.colocate_below_tokens,
                           herd_tolerance=r.placement.herd_tolerance,
                           max_prefill_queue_s=r.liveness.kv_lease_s / 2)
        for rec, w in zip(recs, workers):
            rec.row = w
            rec.sync_load()
        return view

    def _observe_usage(self, rec: WorkerRecord, load: wpb.WorkerLoad) -> None:
        if self.on_load is not None:
            self.on_load(rec.info.worker_id, rec.info.site, Role.of(rec.info.role), load)

    def _dial(self, info: wpb.WorkerInfo) -> tuple[grpc.aio.Channel, wgrpc.PrefillWorkerStub | wgrpc.DecodeWorkerStub]:
        """A channel to ``info``'s worker that accepts only its certificate, and the stub of its role."""
        ident = worker_identity(info)
        channel = self.dialer.aio(info.address, server_name=ident.dns if ident else None)
        return channel, (wgrpc.PrefillWorkerStub(channel) if Role.of(info.role) is Role.PREFILL
                         else wgrpc.DecodeWorkerStub(channel))

    def redial(self) -> int:
        """New channels to every worker (after this router's certificate was renewed: a channel
        presents the certificate it was made with whenever it connects again). Calls made from now
        on take the new channel; the old one closes once its calls end (at most
        :data:`RETIRED_GRACE_S`). Returns how many were redialled."""
        for rec in self.workers.values():
            old, (rec.channel, rec.stub) = rec.channel, self._dial(rec.info)
            task = asyncio.get_running_loop().create_task(old.close(grace=RETIRED_GRACE_S))
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)
        return len(self.workers)

    async def close(self) -> None:
        for rec in self.workers.values():
            await rec.channel.close()
        for task in list(self._retired):
            task.cancel()


def _own_block_size(worker: int, cluster: int) -> int:
    """A worker's block size for placement's view: 0 when it is the cluster's (the common case)."""
    return 0 if worker == cluster else worker
