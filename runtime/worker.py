"""What prefill and decode worker processes share: arguments, the config
and the worker's identity, building the engine, the KV transfer settings,
registering with the router (runtime/heartbeats.py), and serving until a signal. ``prefill_worker/main.py`` and
``decode_worker/main.py`` each build their own side on top of this."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.interface import WorkerEngine
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.kvtransfer.base import Transport
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.select import choose_transport, host_has_rdma
from kvrelay.runtime.config import ClusterConfig, PoolSection, load_config
from kvrelay.runtime.engines import EngineKind, VllmSection, pool_engine_problem
from kvrelay.runtime.fds import handshake_budget, raise_open_files_limit
from kvrelay.runtime.health import HealthChecks, serve_health
from kvrelay.runtime.heartbeats import EventFanout, WorkerStatus, heartbeat_routers, register_and_heartbeat
from kvrelay.runtime.kvcreds import CertCredentials
from kvrelay.runtime.kvsecret import pem_from_env, read_secret, tls_dir_from_env
from kvrelay.runtime.lifetime import die_with_parent
from kvrelay.runtime.pki import CertRole, Identity, PKIError
from kvrelay.runtime.renewal import MaterialFiles, follow_material, material_files
from kvrelay.runtime.revocations import follow_revocations
from kvrelay.runtime.role_gate import PeerGate
from kvrelay.runtime.roles import Role
from kvrelay.runtime.rpc import Dialer, bind, create_server
from kvrelay.runtime.tls import TLSMaterial, load_material, router_identity
from kvrelay.runtime.topology import Topology
from kvrelay.runtime.usage_meter import UsageMeter
from kvrelay.runtime.vllm_engine import VllmEngine, VllmSpec, prepare_process
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerIdentity:
    worker_id: str
    """``site/role/index``, e.g. ``toronto/decode/0``."""
    role: Role
    site: str


def local_address_towards(address: str) -> str:
    """This host's IP address on the route to ``address`` (host:port): what a
    worker on a multi-node cluster advertises (``workers.host: auto``)."""
    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), int(port)))  # UDP: no packet is sent
        return s.getsockname()[0]


def build_engine(cfg: ClusterConfig, model_path: str, kv_shm_path: str | None = None,
                 device: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=Path(model_path), dtype=cfg.model.dtype, device=device or cfg.model.device,
                                  cache=cfg.cache, scheduler=cfg.scheduler, num_threads=cfg.workers.threads,
                                  kv_shm_path=kv_shm_path))


def worker_load(ident: WorkerIdentity, engine: WorkerEngine, kv_in: int = 0, kv_out: int = 0,
                usage: UsageMeter | None = None) -> wpb.WorkerLoad:
    """The load a worker reports (heartbeats, Stats), with its usage counters and incarnation."""
    st = engine.stats()
    return wpb.WorkerLoad(
        worker_id=ident.worker_id, running=st.num_running, waiting=st.num_waiting,
        free_blocks=st.num_free_blocks, total_blocks=st.num_blocks,
        prefill_tokens_total=st.num_prefill_tokens, decode_tokens_total=st.num_decode_tokens,
        kv_bytes_received=kv_in, kv_bytes_sent=kv_out, reservations=engine.num_reserved + engine.num_held,
        prefix_hit_blocks=st.prefix_hit_blocks, prefix_query_blocks=st.prefix_query_blocks,
        queued_prefill_tokens=st.queued_prefill_tokens, prefill_tokens_per_s=st.prefill_tokens_per_s,
        decode_step_ms=st.decode_step_s * 1e3,
        incarnation=usage.incarnation if usage is not None else "",
        usage=usage.protos() if usage is not None else [])


async def serve_until_signal(server: grpc.aio.Server, aengine: AsyncEngine, stop: asyncio.Event,
                             tasks: list[asyncio.Task]) -> BaseException | None:
    """Runs until SIGTERM/SIGINT, a drain, or one of ``tasks`` failing, then
    shuts down gracefully; returns the failure (None after a signal or a drain)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    failure = next((t.exception() for t in done if t is not waiter and t.exception() is not None), None)
    if failure is not None:
        log.error("worker task failed: %s", failure)
    stop.set()
    await server.stop(grace=2.0)
    for t in tasks:
        t.cancel()
    await aengine.stop()
    return failure


def engine_problem(aengine: AsyncEngine) -> str | None:
    """The liveness probe's check of a worker: None while its engine thread runs."""
    dead = aengine.failure is not None or (aengine.dead is not None and aengine.dead.is_set())
    return f"the engine thread died: {aengine.failure!r}" if dead else None


async def engine_watch(aengine: AsyncEngine) -> None:
    """Raises when the engine thread dies, so the worker leaves instead of
    heartbeating as healthy with no engine behind it."""
    await aengine.dead.wait()
    raise RuntimeError(f"the engine thread died: {aengine.failure!r}")


async def leave(setup: WorkerSetup, worker_id: str, load: wpb.WorkerLoad | None = None) -> None:
    """Tells the router this worker is gone, with its final ``load`` (its
    usage counters); best effort, a few seconds at most."""
    try:
        async with setup.dialer.aio(setup.router, server_name=setup.router_name) as ch:
            await wgrpc.RegistryStub(ch).Deregister(wpb.DeregisterRequest(worker_id=worker_id, load=load),
                                                    timeout=3.0)
    except grpc.aio.AioRpcError as exc:
        log.warning("could not deregister %s: %s", worker_id, exc.code())


# -- the worker process ------------------------------------------------------------------------------------------
def parse_args(role: Role, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"{role}_worker")
    p.add_argument("--config", help="cluster config YAML (default: the embedded default)")
    p.add_argument("--model-path", required=True, help="checkpoint folder")
    p.add_argument("--router", required=True, help="router address host:port")
    p.add_argument("--site", required=True)
    name = p.add_mutually_exclusive_group()
    name.add_argument("--index", type=int, default=0, help="the worker's number in its pool (launchers)")
    name.add_argument("--name", type=_worker_name, help="the worker's name in its pool instead of a number, "
                      "e.g. its pod's name (Kubernetes); its certificate must name it")
    p.add_argument("--host", help="address to bind and advertise (default: the config's workers.host)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.name is not None:
        args.index = args.name
    return args


def _worker_name(value: str) -> str:
    """``--name``: what a certificate's name may be (lowercase letters, digits, - or _, at most 63)."""
    if not WORKER_NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} must be lowercase letters, digits, - or _ (at most 63), "
                                         "starting with a letter or digit")
    return value


WORKER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
"""A worker's name in its pool (the last part of its id and of its certificate's identity)."""


@dataclass(slots=True)
class WorkerSetup:
    """What one worker process is, decided once at start from its arguments and config."""

    cfg: ClusterConfig
    ident: WorkerIdentity
    pool: PoolSection
    """This worker's pool in the config (its device)."""
    transport: Transport
    """KV transport of this host: tcp, nixl or local (``kv.transport`` resolved)."""
    transfer: TransferConfig
    """Settings of the KV sender or receiver."""
    host: str
    """Address to bind and advertise."""
    router: str
    """The router's internal (mutual-TLS) address."""
    model_path: str
    tls: TLSMaterial | None
    """This worker's certificate (naming its site, role and index) and the CA; None: tls.enabled false."""
    tls_files: MaterialFiles | None = None
    """Where ``tls`` is renewed from while the worker runs (None: nowhere)."""
    config_path: str | None = None
    """The config file whose ``tls.revoked_serials`` the worker follows (None: the embedded default)."""

    @property
    def dialer(self) -> Dialer:
        return Dialer(self.tls)

    @property
    def router_identities(self) -> frozenset[Identity]:
        """The routers this worker admits and dials: each of ``routers:``, else the one
        router's (``tls.router_identity``)."""
        if not self.cfg.routers:
            return frozenset({router_identity(self.cfg)})
        return frozenset(i for uri in self.cfg.router_uris if (i := Identity.parse(uri)) is not None)

    @property
    def router_name(self) -> str | None:
        """The DNS name the router's certificate must carry when this worker dials ``router``
        (None with several routers: any of theirs, each dialled by its own name once listed)."""
        return None if self.cfg.routers else router_identity(self.cfg).dns


def worker_tls(cfg: ClusterConfig, role: Role, site: str, index: int | str,
               pem: dict[str, bytes]) -> TLSMaterial | None:
    """This worker's TLS material; SystemExit unless its certificate names
    exactly this worker (``pem``: what the launcher handed over)."""
    try:
        tls = load_material(cfg.tls, pem)
    except PKIError as exc:
        raise SystemExit(f"{role} worker: {exc}") from None
    if tls is None:
        return None
    want = f"{site}/{role}/{index}"
    if tls.identity is None or tls.identity.path != want:
        raise SystemExit(f"{role} worker {want}: its certificate names {tls.identity or 'no identity'}; "
                         f"it needs one for kvrelay://{want} (kvrelay pki issue --role {role} --site {site} "
                         f"--name {index})")
    return tls


def worker_setup(role: Role, args: argparse.Namespace, kv_secret_env: str,
                 pem: dict[str, bytes] | None = None, tls_dir: Path | None = None) -> WorkerSetup:
    """Parses the config once and checks this worker's place in it (``pem``, ``tls_dir``:
    the material the launcher handed over, and its folder for it)."""
    cfg = load_config(args.config)
    site = {s.name: s for s in cfg.sites}.get(args.site)
    if site is None:
        raise SystemExit(f"--site {args.site!r} is not a site of the config ({', '.join(s.name for s in cfg.sites)})")
    tls = worker_tls(cfg, role, args.site, args.index, pem or {})
    transfer = kv_transfer_config(cfg, role, args.site, read_secret(cfg.kv.secret_file, kv_secret_env), tls)
    budget = handshake_budget(raise_open_files_limit())  # the KV port's file-descriptor budget
    transfer = replace(transfer, max_pending_handshakes=budget,
                                   max_pending_per_source=min(transfer.max_pending_per_source, budget))
    host = args.host or cfg.workers.host
    if host == "auto":
        host = local_address_towards(args.router)
    transport = choose_transport(cfg.kv.transport)
    pool = site.pool(role)
    problem = pool_engine_problem(pool, f"site {args.site}'s {role} pool", transport, pool.device or cfg.model.device)
    if problem is not None:
        raise SystemExit(problem)
    return WorkerSetup(cfg, WorkerIdentity(f"{args.site}/{role}/{args.index}", role, args.site),
                       site.pool(role), transport, transfer, host, args.router, args.model_path, tls,
                       material_files(cfg.tls, tls_dir, pem or {}), args.config)


def kv_transfer_config(cfg: ClusterConfig, role: Role, site: str, secret: bytes,
                       tls: TLSMaterial | None) -> TransferConfig:
    """This worker's KV transfer settings: the secret, its certificate (a
    prefill worker sends only to decode workers, a decode worker receives
    only from prefill workers) and, receiving, the protection the link from
    each sender's site requires."""
    kv, topo = cfg.kv, Topology(cfg)
    peer = CertRole.DECODE if role is Role.PREFILL else CertRole.PREFILL
    creds = CertCredentials(tls, (peer,)) if tls is not None else None
    return TransferConfig(secret=secret, credentials=creds, streams=kv.streams,
                          socket_buffer_bytes=kv.socket_buffer_bytes, protection=kv.protection,
                          required_protection=lambda peer_site: topo.required_protection(site, peer_site),
                          stall_timeout_s=kv.transfer_timeout_s, corrupt_first=kv.corrupt_first_transfers)


def failing_step(step, at: int):
    """``step``, except that call number ``at`` raises (fault injection: workers.fail_engine_*)."""
    calls = 0

    def wrapped():
        nonlocal calls
        calls += 1
        if calls == at:
            raise RuntimeError(f"injected engine failure at step {at} (workers.fail_engine_at_step)")
        return step()
    return wrapped


def build_vllm_engine(setup: WorkerSetup) -> VllmEngine:
    """A vLLM pool's engine (runtime/vllm_engine.py), in this process."""
    cfg = setup.cfg
    device = setup.pool.device or cfg.model.device
    prepare_process(cfg.workers.threads, device)
    spec = VllmSpec(Path(setup.model_path), setup.ident.worker_id, setup.pool.vllm or VllmSection(),
                    cfg.model.dtype, device, cfg.cache.memory_gib, cfg.scheduler, cfg.cache.block_size)
    return VllmEngine(spec)


async def start_engine(setup: WorkerSetup, kv_shm_path: str | None = None) -> AsyncEngine:
    """Builds this worker's engine (its pool's: builtin or vLLM) and starts its step loop."""
    engine: WorkerEngine
    if setup.pool.engine is EngineKind.VLLM:
        engine = build_vllm_engine(setup)
    else:
        engine = build_engine(setup.cfg, setup.model_path, kv_shm_path, setup.pool.device)
    w = setup.cfg.workers
    if w.fail_engine_worker == setup.ident.worker_id:
        failing = failing_step(engine.step, w.fail_engine_at_step)
        engine.step = failing  # type: ignore[method-assign]  # fault injection: this engine's step fails on purpose
    aengine = AsyncEngine(engine)
    await aengine.start()
    return aengine


def listening_server(setup: WorkerSetup) -> tuple[grpc.aio.Server, int]:
    """The worker's gRPC server, bound to a free port of its host; with TLS,
    it admits only the deployment's router (mutual TLS, the router certificate
    naming exactly ``tls.router_identity``)."""
    if setup.tls is None:
        server = create_server()
    else:
        server = create_server([PeerGate(setup.tls, (CertRole.ROUTER,), only=setup.router_identities)])
    return server, bind(server, setup.host, 0, setup.tls, mutual=True)


def worker_info(setup: WorkerSetup, engine: WorkerEngine, port: int, kv_endpoint: str) -> wpb.WorkerInfo:
    """What the worker tells the router about itself when it registers."""
    layout = engine.layout
    return wpb.WorkerInfo(worker_id=setup.ident.worker_id, role=setup.ident.role.proto, site=setup.ident.site,
                          address=f"{setup.host}:{port}", kv_endpoint=kv_endpoint, transport=setup.transport,
                          model=engine.model_config.name, layout_hash=layout.compat_hash(),
                          block_size=layout.block_size, num_blocks=engine.cache.num_blocks,
                          num_layers=layout.num_layers, kv_block_bytes=layout.bytes_per_block,
                          device=str(engine.cache.kv.device))


async def serve_worker(setup: WorkerSetup, aengine: AsyncEngine, server: grpc.aio.Server, info: wpb.WorkerInfo,
                       load_fn) -> None:
    """Serves, registers and heartbeats until a signal or a drain; then shuts
    down. SystemExit(1), after deregistering, when the engine thread dies or
    the router refuses this worker: the launcher replaces it."""
    log.info("%s serving on %s (kv %s)", info.worker_id, info.address, info.kv_endpoint or "-")
    await server.start()
    stop = asyncio.Event()
    status = WorkerStatus()
    health = serve_health(setup.cfg.health.host, setup.cfg.health.worker_port,
                          HealthChecks(asyncio.get_running_loop(), lambda: engine_problem(aengine), status.not_ready))
    fanout = EventFanout(aengine)
    if len(setup.cfg.routers) > 1:
        hb = asyncio.create_task(heartbeat_routers(setup.router, frozenset(setup.cfg.router_uris), setup.dialer, info,
                                                   load_fn, stop, fanout, status))
    else:
        hb = asyncio.create_task(register_and_heartbeat(setup.router, setup.dialer, info, load_fn, stop,
                                                        lambda snapshot: fanout.take("", snapshot), status=status,
                                                        router_name=setup.router_name))
    tasks = [hb, asyncio.create_task(engine_watch(aengine)), *followers(setup, stop)]
    try:
        failure = await serve_until_signal(server, aengine, stop, tasks)
    finally:
        aengine.engine.cache.unlink()
        if health is not None:
            health.close()
    if failure is not None:
        await leave(setup, info.worker_id, load_fn())
        raise SystemExit(1)


def followers(setup: WorkerSetup, stop: asyncio.Event) -> list[asyncio.Task]:
    """Tasks that run until ``stop`` (any that ends earlier ends the worker): its material renewed from
    its files, its revoked serials from its config file."""
    if setup.tls is None:
        return []
    tasks = [asyncio.create_task(follow_material(setup.tls_files, setup.tls, stop))] if setup.tls_files else []
    if setup.config_path is not None:
        tasks.append(asyncio.create_task(follow_revocations(setup.config_path, setup.tls.revoked, stop)))
    return tasks


def worker_main(role: Role, argv: list[str] | None, run) -> int:
    """The process entry both workers share: ``run(setup)`` is the worker's own coroutine."""
    die_with_parent()
    args = parse_args(role, argv)
    if not host_has_rdma():  # UCX's InfiniBand module crashes processes at exit without devices
        os.environ.setdefault("UCX_MODULES", "^ib")
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s {role}[{args.site}/{args.index}] %(levelname)s "
                        "%(name)s: %(message)s", stream=sys.stderr)
    setup = worker_setup(role, args, os.environ.get("KVRELAY_KV_SECRET", ""), pem_from_env(), tls_dir_from_env())
    asyncio.run(run(setup))
    return 0
