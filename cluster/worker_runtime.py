"""What prefill and decode workers share: building the engine from the
cluster config, registering with the router and heartbeating load."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from cluster.config import ClusterConfig
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)

EVENTS_WAIT_S = 0.2
"""How long a heartbeat waits for the engine's prefix-cache events before going without them."""

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


@dataclass(slots=True)
class WorkerIdentity:
    worker_id: str
    role: int
    site: str


def local_address_towards(address: str) -> str:
    """This host's IP address on the route to ``address`` (host:port): what a
    worker on a multi-node cluster advertises (``workers.host: auto``)."""
    import socket

    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), int(port)))  # UDP: no packet is sent
        return s.getsockname()[0]


def build_engine(cfg: ClusterConfig, model_path: str, kv_shm_path: str | None = None,
                 device: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=model_path, dtype=cfg.model.dtype, device=device or cfg.model.device,
                                  cache=cfg.cache, scheduler=cfg.scheduler, num_threads=cfg.workers.threads,
                                  kv_shm_path=kv_shm_path))


def worker_load(ident: WorkerIdentity, engine: LLMEngine, kv_in: int = 0, kv_out: int = 0) -> wpb.WorkerLoad:
    st = engine.stats()
    return wpb.WorkerLoad(
        worker_id=ident.worker_id, running=st.num_running, waiting=st.num_waiting,
        free_blocks=st.num_free_blocks, total_blocks=st.num_blocks,
        prefill_tokens_total=st.num_prefill_tokens, decode_tokens_total=st.num_decode_tokens,
        kv_bytes_received=kv_in, kv_bytes_sent=kv_out, reservations=engine.num_reserved + engine.num_held,
        prefix_hit_blocks=st.prefix_hit_blocks, prefix_query_blocks=st.prefix_query_blocks,
        queued_prefill_tokens=st.queued_prefill_tokens, prefill_tokens_per_s=st.prefill_tokens_per_s,
        decode_step_ms=st.decode_step_s * 1e3)


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
    except asyncio.TimeoutError:
        return wpb.LinkReport(site=target.site, reachable=False,
                              error=f"no answer from {target.address} within {timeout_s:g} s")
    except (OSError, ValueError) as exc:
        return wpb.LinkReport(site=target.site, reachable=False, error=f"{target.address}: {exc}")
    return wpb.LinkReport(site=target.site, reachable=True, connect_ms=(time.perf_counter() - t0) * 1e3)


async def kv_events(aengine: AsyncEngine, snapshot: bool) -> wpb.KVCacheEvents:
    """The engine's prefix-cache changes (or a full snapshot) for a heartbeat."""
    ev = await aengine.call(aengine.engine.drain_kv_events, snapshot)
    return wpb.KVCacheEvents(stored=ev.stored, removed=ev.removed, snapshot=snapshot)


class _Heartbeats:
    """One worker's registration and heartbeat state with its router."""

    def __init__(self, stub, info: wpb.WorkerInfo, load_fn, events_fn) -> None:
        self.stub, self.info, self.load_fn, self.events_fn = stub, info, load_fn, events_fn
        self.interval = 1.0
        self.registered = False
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
        req = wpb.HeartbeatRequest(load=self.load_fn())
        reports = asyncio.gather(*(probe_site(t, self.probe_timeout_s) for t in self.probes))
        if self.events_fn is not None:
            await self._events(req)  # while the probes run
        req.links.extend(await reports)
        hb = await self.stub.Heartbeat(req, timeout=5.0)
        self.registered, self.snapshot = hb.known, hb.send_snapshot
        self.probes, self.probe_timeout_s = list(hb.probes), hb.probe_timeout_s or self.probe_timeout_s
        if hb.drain and not self.draining:
            self.draining = True
            log.info("%s is draining: no new requests; leaving once the current ones are done", self.info.worker_id)
        if hb.drained:
            await self.stub.Deregister(wpb.DeregisterRequest(worker_id=self.info.worker_id), timeout=5.0)
            log.info("%s drained: deregistered, exiting", self.info.worker_id)
        return hb.drained


async def register_and_heartbeat(router: str, info: wpb.WorkerInfo, load_fn, stop: asyncio.Event,
                                 events_fn=None, register_deadline_s: float = 60.0) -> None:
    """Registers with the router (retrying until the deadline), then sends a
    heartbeat every interval until ``stop`` is set; re-registers when the
    router has forgotten this worker (router restart). When the router says
    the worker is drained (scale-down, ``kvrelay drain``), it deregisters,
    sets ``stop`` and returns, so the process exits.

    ``events_fn(snapshot)`` returns the prefix-cache events to send; after a
    heartbeat that did not arrive, or when the router asks, a full snapshot
    replaces them, so the router's prefix index never drifts."""
    async with grpc.aio.insecure_channel(router, options=GRPC_OPTIONS) as ch:
        hb = _Heartbeats(wgrpc.RegistryStub(ch), info, load_fn, events_fn)
        loop = asyncio.get_running_loop()
        end = loop.time() + register_deadline_s
        try:
            while not stop.is_set():
                try:
                    if await hb.beat():
                        stop.set()
                        return
                except grpc.aio.AioRpcError as exc:
                    if not hb.registered and loop.time() > end:
                        raise RuntimeError(f"could not register with router {router}: {exc.details()}") from None
                    log.debug("router %s unreachable: %s", router, exc.code())
                try:
                    await asyncio.wait_for(stop.wait(), hb.interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            if hb.pending is not None:
                hb.pending.cancel()


async def serve_until_signal(server: grpc.aio.Server, aengine: AsyncEngine, stop: asyncio.Event,
                             tasks: list[asyncio.Task]) -> None:
    """Runs until SIGTERM/SIGINT, then shuts down gracefully."""
    import signal

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not waiter and t.exception() is not None:
            log.error("worker task failed: %s", t.exception())
    stop.set()
    await server.stop(grace=2.0)
    for t in tasks:
        t.cancel()
    await aengine.stop()
