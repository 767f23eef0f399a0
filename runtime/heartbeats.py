"""A worker's standing with the routers: registering, a heartbeat every
interval with its load, its prefix-cache events and its link probes, and
leaving when drained.

With one router, one loop (:func:`register_and_heartbeat`). With several
(``routers:``), :func:`heartbeat_routers`: the worker registers with the router
it was started with, learns every live router from the answers, and
heartbeats each (a worker another router registered is known there through
etcd; one that is not, registers there too). Each router gets every prefix-cache
change: :class:`EventFanout` drains the engine once per heartbeat and keeps each
router's share until its next heartbeat takes it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.runtime.pki import CertRole, Identity, role_dns
from kvrelay.runtime.rpc import Dialer
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)

RoutersSink = Callable[[list[ipb.RouterPeer]], None]
"""Where a router's answer's list of live routers goes."""
EventsFn = Callable[[bool], Awaitable[wpb.KVCacheEvents]]
"""``events_fn(snapshot)``: the prefix-cache events one router's next heartbeat carries."""

REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
"""Registry answers that end a worker: its certificate or its claim is wrong."""

EVENTS_WAIT_S = 0.2
"""How long a heartbeat waits for the engine's prefix-cache events before going without them."""


async def probe_site(target: wpb.ProbeTarget, timeout_s: float) -> wpb.LinkReport:
    """Can this host reach ``target``? A TCP connect: accepted or refused
    (the host answered), the path works; no answer in time, or no route, it
    does not."""
    host, _, port = target.address.rpartition(":")
    t0 = time.perf_counter()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
        writer.close()
    except ConnectionRefusedError:
        pass
    except TimeoutError:
        return wpb.LinkReport(site=target.site, reachable=False,
                              error=f"no answer from {target.address} within {timeout_s:g} s")
    except (OSError, ValueError) as exc:
        return wpb.LinkReport(site=target.site, reachable=False, error=f"{target.address}: {exc}")
    return wpb.LinkReport(site=target.site, reachable=True, connect_ms=(time.perf_counter() - t0) * 1e3)


class EventFanout:
    """The engine's prefix-cache changes for one or more routers: each heartbeat drains the
    engine once and adds what it drained to every router's share; a router's heartbeat takes
    its own share (or a snapshot, which leaves the other routers' shares as they are)."""

    MAX_PENDING = 1 << 20
    """Hashes kept for one router at most; past it, that router gets a snapshot instead."""

    def __init__(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine
        self.pending: dict[str, dict[int, bool]] = {}
        """Per router: each changed hash and whether it is cached now (True) or was removed."""
        self._lock = asyncio.Lock()

    def _drain(self, snapshot: bool) -> tuple[wpb.KVCacheEvents, list[int] | None]:
        """On the engine thread: the changes since the last drain, and every cached hash if ``snapshot``."""
        engine = self.aengine.engine
        ev = engine.drain_kv_events(False)
        full = list(engine.drain_kv_events(True).stored) if snapshot else None
        return wpb.KVCacheEvents(stored=ev.stored, removed=ev.removed), full

    async def take(self, router: str, snapshot: bool) -> wpb.KVCacheEvents:
        """What ``router``'s next heartbeat carries: its changes since its last, or a full snapshot."""
        async with self._lock:  # drains merge in the order they happened
            mine = self.pending.setdefault(router, {})
            ev, full = await self.aengine.call(self._drain, snapshot or len(mine) > self.MAX_PENDING)
            if full is None and not mine and len(self.pending) == 1:  # one router, nothing held: as drained
                return ev
            for share in self.pending.values():
                merge_events(share, ev)
            self.pending[router] = {}
            if full is not None:
                return wpb.KVCacheEvents(stored=full, snapshot=True)
            return wpb.KVCacheEvents(stored=[h for h, cached in mine.items() if cached],
                                     removed=[h for h, cached in mine.items() if not cached])

    def forget(self, router: str) -> None:
        """``router`` left: its share is dropped."""
        self.pending.pop(router, None)


def merge_events(share: dict[int, bool], ev: wpb.KVCacheEvents) -> None:
    """Adds one drain's changes to a router's share (removed before stored, as the index applies them)."""
    for h in ev.removed:
        share[h] = False
    for h in ev.stored:
        share[h] = True



@dataclass(slots=True)
class WorkerStatus:
    """A worker's standing with its router, as its readiness probe reads it (runtime/health.py)."""

    registered: bool = False
    """The router knows this worker (set by the last Register or Heartbeat answer)."""
    draining: bool = False
    """The router told this worker to take no new requests."""

    def not_ready(self) -> str | None:
        """None when the router may place new requests here, else why not."""
        if self.draining:
            return "draining: the router places no new requests here"
        return None if self.registered else "not registered with the router"


class _Heartbeats:
    """One worker's registration and heartbeat state with its router."""

    def __init__(self, stub, info: wpb.WorkerInfo, load_fn, events_fn, status: WorkerStatus | None = None,
                 registered: bool = False, on_routers: RoutersSink | None = None,
                 on_drained: Callable[[bool], None] | None = None) -> None:
        self.stub, self.info, self.load_fn, self.events_fn = stub, info, load_fn, events_fn
        self.on_drained = on_drained
        """With several routers: given this router's drained flag from each answer; the worker leaves
        when every router says it is drained, not when this one does."""
        self.status = status if status is not None else WorkerStatus()
        self.interval = 1.0
        self.registered = registered
        """Known to this router (a router learned from another knows us through etcd: no Register)."""
        self.on_routers = on_routers
        self.snapshot = True
        """Send a full prefix-cache snapshot next (after registering, a lost heartbeat, or when asked)."""
        self.draining = False
        self.pending: asyncio.Future | None = None
        """Prefix-cache events being fetched from the engine thread."""
        self.probes: list[wpb.ProbeTarget] = []
        """Workers in linked sites the router asked us to probe (link-down detection)."""
        self.probe_timeout_s = 1.0

    async def _events(self, req: wpb.HeartbeatRequest) -> None:
        # the events come from the engine thread, which may be inside a long step:
        # never hold the heartbeat (liveness) for them; they go in the next one
        if self.pending is None:
            self.pending = asyncio.ensure_future(self.events_fn(self.snapshot))
        await asyncio.wait({self.pending}, timeout=EVENTS_WAIT_S)
        if self.pending.done():
            req.kv_events.CopyFrom(self.pending.result())
            self.pending = None
            self.snapshot = True  # until this heartbeat is known to have arrived

    async def beat(self) -> bool:
        """Registers if needed and sends one heartbeat; True once drained and deregistered."""
        if not self.registered:
            resp = await self.stub.Register(wpb.RegisterRequest(info=self.info), timeout=5.0)
            self.interval = resp.heartbeat_interval_s or 1.0
            self.registered, self.snapshot = True, True
            log.info("registered %s with the router", self.info.worker_id)
            if self.on_routers is not None:
                self.on_routers(resp.routers)
        req = wpb.HeartbeatRequest(load=self.load_fn())
        reports = asyncio.gather(*(probe_site(t, self.probe_timeout_s) for t in self.probes))
        if self.events_fn is not None:
            await self._events(req)  # while the probes run
        req.links.extend(await reports)
        hb = await self.stub.Heartbeat(req, timeout=5.0)
        self.registered, self.snapshot = hb.known, hb.send_snapshot
        self.status.registered = hb.known
        self.probes, self.probe_timeout_s = list(hb.probes), hb.probe_timeout_s or self.probe_timeout_s
        if self.on_routers is not None and hb.known:
            self.on_routers(hb.routers)
        if hb.drain and not self.draining:
            self.draining = self.status.draining = True
            log.info("%s is draining: no new requests; leaving once the current ones are done", self.info.worker_id)
        if self.on_drained is not None:
            self.on_drained(hb.drained)
            return False
        if hb.drained:  # with the final counters: nothing runs here any more
            await self.stub.Deregister(wpb.DeregisterRequest(worker_id=self.info.worker_id, load=self.load_fn()),
                                       timeout=5.0)
            log.info("%s drained: deregistered, exiting", self.info.worker_id)
        return hb.drained


class RouterChannel:
    """A worker's channel to a router, made again once this process's certificate was renewed:
    a channel presents the certificate it was made with whenever it connects again (after the
    router restarts, one that may have expired since)."""

    def __init__(self, dialer: Dialer, router: str, server_name: str) -> None:
        self.dialer, self.router, self.server_name = dialer, router, server_name
        self.channel = self._dial()

    def _generation(self) -> int:
        return self.dialer.tls.generation if self.dialer.tls is not None else 0

    def _dial(self) -> grpc.aio.Channel:
        self.generation = self._generation()
        return self.dialer.aio(self.router, server_name=self.server_name)

    async def renewed(self) -> bool:
        """True when the material changed since the channel was made: it is made again (call
        between calls: the old one closes at once)."""
        if self._generation() == self.generation:
            return False
        old, self.channel = self.channel, self._dial()
        await old.close()
        return True

    async def __aenter__(self) -> RouterChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()


async def register_and_heartbeat(router: str, dialer: Dialer, info: wpb.WorkerInfo, load_fn, stop: asyncio.Event,
                                 events_fn=None, register_deadline_s: float = 60.0,
                                 status: WorkerStatus | None = None, router_name: str | None = None,
                                 registered: bool = False, on_routers: RoutersSink | None = None,
                                 on_drained: Callable[[bool], None] | None = None) -> None:
    """Registers with the router (retrying until the deadline), then sends a
    heartbeat every interval until ``stop`` is set; re-registers when the
    router has forgotten this worker (router restart). When the router says
    the worker is drained (scale-down, ``kvrelay drain``), it deregisters,
    sets ``stop`` and returns, so the process exits.

    ``events_fn(snapshot)`` returns the prefix-cache events to send; after a
    heartbeat that did not arrive, or when the router asks, a full snapshot
    replaces them, so the router's prefix index never drifts. The channel
    accepts only a server whose certificate carries ``router_name`` (the
    deployment's router exactly; None: any router certificate).
    ``status`` follows the router's answers (the readiness probe reads it).
    ``registered``: the router knows this worker already (no Register unless it says it does not);
    ``on_routers``: given the deployment's live routers from each answer; ``on_drained``: given the
    router's drained flag instead of leaving when it is set (several routers)."""
    async with RouterChannel(dialer, router, router_name or role_dns(CertRole.ROUTER)) as ch:
        hb = _Heartbeats(wgrpc.RegistryStub(ch.channel), info, load_fn, events_fn, status, registered, on_routers,
                         on_drained)
        loop = asyncio.get_running_loop()
        end = loop.time() + register_deadline_s
        try:
            while not stop.is_set():
                if await ch.renewed():
                    hb.stub = wgrpc.RegistryStub(ch.channel)
                try:
                    if await hb.beat():
                        stop.set()
                        return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in REFUSALS:  # the router will not take us: retrying cannot help
                        raise RuntimeError(f"router {router} refused {info.worker_id}: {exc.details()}") from None
                    if not hb.registered and loop.time() > end:
                        raise RuntimeError(f"could not register with router {router}: {exc.details()}") from None
                    log.debug("router %s unreachable: %s", router, exc.code())
                try:
                    await asyncio.wait_for(stop.wait(), hb.interval)
                except TimeoutError:
                    pass
        finally:
            if hb.pending is not None:
                hb.pending.cancel()


@dataclass(slots=True)
class RouterLoops:
    """A worker's heartbeat loops, one per live router of a deployment with several."""

    admitted: frozenset[str]
    """The router identities the deployment lists (``routers:``): the only ones dialled."""
    peers: dict[str, ipb.RouterPeer] = field(default_factory=dict)
    """The live routers by internal address, as the last answer listed them."""
    drained: dict[str, bool] = field(default_factory=dict)
    """Each router's last word on this worker's drain (by internal address)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def all_drained(self, addresses) -> bool:
        """Every router of ``addresses`` said this worker is drained (nothing of theirs runs here)."""
        return bool(addresses) and all(self.drained.get(a, False) for a in addresses)

    def reporter(self, address: str) -> Callable[[bool], None]:
        def report(drained: bool) -> None:
            self.drained[address] = drained
            if drained:
                self.changed.set()
        return report

    def update(self, routers: list[ipb.RouterPeer]) -> None:
        """A router's answer: the live routers now (those the deployment does not list are ignored)."""
        live = {}
        for r in routers:
            try:
                ident = Identity(r.site, CertRole.ROUTER, r.name)
            except ValueError:
                continue
            if ident.uri in self.admitted and r.internal_address:
                live[r.internal_address] = r
        if live and live.keys() != self.peers.keys():
            self.peers = live
            self.changed.set()


async def heartbeat_routers(first: str, admitted: frozenset[str], dialer: Dialer, info: wpb.WorkerInfo, load_fn,
                            stop: asyncio.Event, fanout: EventFanout | None,
                            status: WorkerStatus | None = None) -> None:
    """Registers with the router at ``first``, then heartbeats every live router the answers
    list (``admitted``: the deployment's router identities; each is dialled by its own name);
    a router that leaves the list loses its loop. Ends when ``stop`` is set or a loop ends
    (drained: ``stop`` is set; refused: its RuntimeError)."""
    loops = RouterLoops(admitted)

    def events_for(address: str) -> EventsFn | None:
        return None if fanout is None else (lambda snapshot: fanout.take(address, snapshot))

    tasks = {first: asyncio.create_task(register_and_heartbeat(
        first, dialer, info, load_fn, stop, events_for(first), status=status, on_routers=loops.update,
        on_drained=loops.reporter(first)))}
    try:
        while not stop.is_set():
            for task in [t for t in tasks.values() if t.done()]:
                task.result()  # a refusal ends the worker
            if loops.peers:
                _follow(loops, tasks, fanout, lambda a, r: register_and_heartbeat(
                    a, dialer, info, load_fn, stop, events_for(a), status=status, registered=True,
                    router_name=Identity(r.site, CertRole.ROUTER, r.name).dns, on_routers=loops.update,
                    on_drained=loops.reporter(a)))
            if loops.all_drained(list(tasks)):
                await _leave(dialer, next(iter(tasks)), info, load_fn)
                stop.set()
                return
            loops.changed.clear()
            waits = {asyncio.ensure_future(loops.changed.wait()), asyncio.ensure_future(stop.wait()),
                     *tasks.values()}
            _, pending = await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for w in pending - set(tasks.values()):
                w.cancel()
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def _leave(dialer: Dialer, router: str, info: wpb.WorkerInfo, load_fn) -> None:
    """Deregisters (with the final counters) at one router: the others learn it through etcd."""
    try:
        async with dialer.aio(router, server_name=role_dns(CertRole.ROUTER)) as ch:
            await wgrpc.RegistryStub(ch).Deregister(wpb.DeregisterRequest(worker_id=info.worker_id, load=load_fn()),
                                                    timeout=5.0)
    except grpc.aio.AioRpcError as exc:
        log.warning("could not deregister %s at %s: %s", info.worker_id, router, exc.code())
    log.info("%s drained at every router: deregistered, exiting", info.worker_id)


def _follow(loops: RouterLoops, tasks: dict[str, asyncio.Task], fanout: EventFanout | None, start) -> None:
    """One loop per live router: new routers get one, routers gone lose theirs."""
    for address in [a for a in tasks if a not in loops.peers]:
        tasks.pop(address).cancel()
        if fanout is not None:
            fanout.forget(address)
        log.info("router at %s left: no more heartbeats there", address)
    for address, peer in loops.peers.items():
        if address not in tasks:
            log.info("heartbeating router %s (%s) at %s too", peer.name, peer.site, address)
            tasks[address] = asyncio.create_task(start(address, peer))
