"""Entry point of the router process (``python -m kvrelay.router``). Prints
``READY host:port internal=host:port [http=host:port]`` on stdout once
serving, for the launcher: the public gRPC listener (TLS; clients present
bearer tokens), the internal one (mutual TLS; workers, and operators and
tenants with certificates), then the OpenAI-compatible HTTP API (TLS) when
enabled. The same services answer on both gRPC listeners; each call is
authorised by what its peer presented (router/frontends/peer.py)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import logging
import os
import secrets
import signal
import ssl
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvrelay.engine.config import ModelConfig, effective_max_model_len
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.router.cluster.membership import EtcdMembership, Membership, SoloMembership
from kvrelay.router.cluster.pools import PoolManager
from kvrelay.router.cluster.registry import RETIRED_GRACE_S, WorkerRegistry
from kvrelay.router.cluster.shared_values import SharedNames
from kvrelay.router.cluster.usage import UsageLedger, UsageNames
from kvrelay.router.core.admission import FairQueue
from kvrelay.router.core.auth import CallerAuth, TenantSalts
from kvrelay.router.core.disk import DiskCollector, DiskReserve
from kvrelay.router.core.jobs_store import JobStorage, JobStoreUnavailable
from kvrelay.router.core.observe import TARGETS_REFRESH_S, RouterTelemetry, write_targets
from kvrelay.router.core.pipeline import CoreParts, RouterCore
from kvrelay.router.core.quotas import Quotas
from kvrelay.router.core.records import RecordKind
from kvrelay.router.core.requests import ModelLimits
from kvrelay.router.core.resume import ResumeTickets
from kvrelay.router.core.shared_jobs import SharedJobStore, conninfo
from kvrelay.router.core.shared_quotas import QuotaExchange
from kvrelay.router.core.tenancy import ANONYMOUS, TenantPolicies
from kvrelay.router.frontends.grpc_api import WORKER_CALLS, add_router_to_server
from kvrelay.router.frontends.http_server import GuardedServer, serve_http
from kvrelay.router.frontends.jobs import JobService, add_jobs_to_server
from kvrelay.router.frontends.openai_http import OpenAIServer
from kvrelay.router.frontends.peer import GrpcCaller
from kvrelay.router.governance.audit_heads import HeadsError, HeadSigner, heads_path, load_signing_key
from kvrelay.router.governance.audit_writer import AuditWriter
from kvrelay.router.governance.retention import RetentionSweeper
from kvrelay.router.placement.place import make_policy
from kvrelay.runtime.config import ClusterConfig, load_config
from kvrelay.runtime.etcd import EtcdClient, EtcdError
from kvrelay.runtime.health import HealthChecks, serve_health
from kvrelay.runtime.kvsecret import pem_from_env, read_secret, tls_dir_from_env
from kvrelay.runtime.lifetime import die_with_parent
from kvrelay.runtime.metrics import CertificateCollector, serve_metrics
from kvrelay.runtime.pki import CertRole, Identity, PKIError, write_private
from kvrelay.runtime.renewal import follow_material, material_files
from kvrelay.runtime.revocations import follow_revocations
from kvrelay.runtime.rpc import PLAINTEXT, CallBounds, Dialer, bind, create_server
from kvrelay.runtime.tls import Pems, TLSMaterial, load_material, router_identity
from kvrelay.runtime.topology import Topology
from kvrelay.runtime.tracing import NO_TRACING, Tracing
from kvrelay.v1 import inference_pb2 as ipb


def named_router(cfg: ClusterConfig, name: str | None) -> ClusterConfig:
    """The config as this router runs it: with ``routers:`` listed, router ``name``'s site and
    listeners in ``router:`` (a copy); SystemExit naming the problem when ``name`` does not fit."""
    listed = ", ".join(r.name for r in cfg.routers)
    if not cfg.routers:
        if name:
            raise SystemExit(f"router: --name {name}, but the config lists no routers: (a single router has no name)")
        return cfg
    entry = cfg.router_entry(name or "")
    if entry is None:
        raise SystemExit(f"router: the config lists routers ({listed}): start each with --name <one of them>"
                         + (f", not {name!r}" if name else ""))
    if len(cfg.routers) > 1 and not cfg.etcd.endpoints:
        raise SystemExit(f"router {name}: {len(cfg.routers)} routers ({listed}) share their state in etcd, and "
                         "etcd.endpoints is empty (kvrelay serve starts etcd for you; otherwise list its members)")
    if len(cfg.routers) > 1 and not cfg.postgres.endpoints:
        raise SystemExit(f"router {name}: {len(cfg.routers)} routers ({listed}) share their batch jobs in "
                         "PostgreSQL, and postgres.endpoints is empty (kvrelay serve starts it for you; otherwise "
                         "list its servers)")
    cfg = copy.deepcopy(cfg)
    r = cfg.router
    r.site, r.host, r.port, r.internal_port, r.http_port = (entry.site, entry.host, entry.port, entry.internal_port,
                                                            entry.http_port)
    return cfg


def pinned_identity(cfg: ClusterConfig, name: str | None) -> Identity:
    """The identity this router's certificate must name: its entry's in ``routers:``, else the one router's."""
    entry = cfg.router_entry(name) if name else None
    ident = Identity.parse(entry.uri) if entry is not None else router_identity(cfg)
    if ident is None:
        raise SystemExit(f"router: {entry.uri if entry else cfg.router_uri} names no kvrelay router")
    return ident


def router_tls(cfg: ClusterConfig, name: str | None = None, pem: dict[str, bytes] | None = None) -> TLSMaterial | None:
    """The router's material (``pem``: what the launcher handed over); SystemExit unless its
    certificate is a router's."""
    try:
        tls = load_material(cfg.tls, pem)
    except PKIError as exc:
        raise SystemExit(f"router: {exc}") from None
    if tls is not None and (tls.identity is None or tls.identity.role is not CertRole.ROUTER):
        raise SystemExit(f"router: its certificate names {tls.identity or 'nothing'}, not a router "
                         "(kvrelay pki issue --role router)")
    pinned = pinned_identity(cfg, name)
    if tls is not None and tls.identity != pinned:
        raise SystemExit(f"router: its certificate names {tls.identity}, but workers admit only {pinned} "
                         "(tls.router_identity; kvrelay pki issue --role router --site <site> --name <name> "
                         "for the one they admit)")
    return tls


class MaterialCopies:
    """Copies of the router's material for libraries that read files (uvicorn's HTTPS, libpq), in
    private folders: written at start, written again after each renewal."""

    def __init__(self, tls: TLSMaterial | None) -> None:
        self.tls = tls
        self.copies: list[tuple[Path, Path, Path]] = []

    def write(self, ca: Path, cert: Path, key: Path, what: str) -> tuple[str, str, str] | None:
        """The router's CA bundle, certificate and key into these files (None when TLS is off)."""
        if self.tls is None:
            return None
        if self.tls.cert_pem is None or self.tls.key_pem is None:  # router_tls has checked that it names a router
            raise PKIError(f"the router's {what} needs its certificate and key (tls.cert / tls.key)")
        self.copies.append((ca, cert, key))
        self._write(ca, cert, key)
        return str(ca), str(cert), str(key)

    def _write(self, ca: Path, cert: Path, key: Path) -> None:
        tls = self.tls
        assert tls is not None and tls.cert_pem is not None and tls.key_pem is not None  # checked in write()
        for path, pem in ((key, tls.key_pem), (cert, tls.cert_pem), (ca, tls.ca_pem)):
            write_private(path, pem)

    def rewrite(self) -> None:
        for files in self.copies:
            self._write(*files)


@dataclass(slots=True)
class Renewal:
    """What the router does when its certificate, key or CA bundle are renewed (its listeners take
    the new material at their next handshake by themselves): copies rewritten, the HTTPS context
    remade, and channels to workers and etcd made again, since a channel presents the certificate it
    was made with whenever it connects again."""

    copies: MaterialCopies
    registry: WorkerRegistry
    http: GuardedServer | None = None
    etcd: EtcdClient | None = None

    def __call__(self, pems: Pems) -> None:
        self.copies.rewrite()
        if self.http is not None:
            try:
                self.http.reload_tls()
            except (ssl.SSLError, OSError) as exc:
                logging.getLogger(__name__).error("the HTTPS listener keeps its old certificate: %s", exc)
        redialled = self.registry.redial()
        if self.etcd is not None:
            self.etcd.redial(RETIRED_GRACE_S)
        logging.getLogger(__name__).info("renewed material in use; %d worker channels made again", redialled)


def audit_log(cfg) -> AuditWriter | None:
    """The router's audit log (router.records.audit_log), resumed where it ended and
    written off the event loop; None (and a warning) when unset."""
    rec = cfg.router.records
    if rec.audit_log:
        return AuditWriter(rec.audit_log, signer=head_signer(rec), head_interval_s=rec.audit_head_interval_s)
    if rec.audit_signing_key:
        raise SystemExit("router: router.records.audit_signing_key is set but router.records.audit_log is not: "
                         "there is no log to sign")
    logging.getLogger(__name__).warning("router.records.audit_log is not set: requests and operator actions "
                                        "are not audited")
    return None


def head_signer(rec) -> HeadSigner | None:
    """The signer of the audit log's heads (router.records.audit_signing_key); SystemExit naming a bad key."""
    if not rec.audit_signing_key:
        return None
    try:
        key = load_signing_key(rec.audit_signing_key)
    except HeadsError as exc:
        raise SystemExit(f"router: router.records.audit_signing_key: {exc}") from None
    return HeadSigner(key, rec.audit_heads or heads_path(rec.audit_log), Path(rec.audit_log).name)


async def _stopped(task: asyncio.Task, timeout_s: float, what: str) -> None:
    """Waits for ``task`` to end, at most ``timeout_s``: the rest of a shutdown matters more."""
    try:
        await asyncio.wait_for(task, timeout_s)
    except TimeoutError:
        logging.getLogger(__name__).warning("%s did not stop within %.0f s; shutting down anyway", what, timeout_s)


async def keep_targets(core: RouterCore, path: str | None, stop: asyncio.Event) -> None:
    """Keeps ``telemetry.prometheus_targets`` (a file_sd file) listing every process's
    /metrics, rewritten (atomically) whenever workers come or go."""
    last = None
    while path and not stop.is_set():
        targets = core.metrics_targets()
        if targets != last:
            try:
                write_targets(Path(path), targets)
                last = targets
            except OSError as exc:
                logging.getLogger(__name__).warning("could not write %s: %s", path, exc)
        try:
            await asyncio.wait_for(stop.wait(), TARGETS_REFRESH_S)
        except TimeoutError:
            pass


def revocations_audited(audit: AuditWriter | None):
    """What records a change of ``tls.revoked_serials`` in the audit log (an operator's action on the config)."""
    def changed(added: frozenset[int], removed: frozenset[int]) -> None:
        if audit is not None:
            audit.append(RecordKind.OPERATOR, {"operator": "config", "action": "revoked serials",
                                               "added": [f"{s:x}" for s in sorted(added)],
                                               "removed": [f"{s:x}" for s in sorted(removed)]})
    return changed


def model_limits(cfg: ClusterConfig, args: argparse.Namespace) -> tuple[Tokenizer, ModelLimits]:
    """The model's tokenizer and what a request may ask of it."""
    model_cfg = ModelConfig.from_file(f"{args.model_path}/config.json")
    tok = Tokenizer(args.model_path)
    return tok, ModelLimits(name=args.model_name or model_cfg.name,
                            max_model_len=effective_max_model_len(model_cfg, cfg.scheduler),
                            vocab_size=model_cfg.vocab_size, chat=tok.has_chat_template)


def core_parts(cfg: ClusterConfig, dialer: Dialer = PLAINTEXT, policy_seed: int | None = None,
               salt_key: bytes | None = None, tracing: Tracing = NO_TRACING,
               metrics: CollectorRegistry | None = None, jobs_db: str | None = None) -> CoreParts:
    """What the core works with, each part built after those it needs. ``dialer``:
    how to reach workers (the router's certificate). ``salt_key``: keys tenants'
    prefix-cache salts (the KV secret; None: a random key for this process's
    life). ``metrics``: the registry the process serves as /metrics (None: one
    of the core's own). ``jobs_db``: the jobs database (None: router.records.jobs_db)."""
    records = cfg.router.records
    usage = UsageLedger(records.usage_db, names=UsageNames.of(cfg, ANONYMOUS))
    registry = WorkerRegistry(cfg, dialer, on_load=usage.take_heartbeat)
    telemetry = RouterTelemetry(tracing, metrics, durable=usage, links=registry.link_states)
    disk = DiskReserve({"jobs_db": jobs_db or records.jobs_db, "audit_log": records.audit_log,
                        "usage_db": records.usage_db}, records)
    telemetry.registry.register(DiskCollector(disk))
    key = salt_key or secrets.token_bytes(32)
    return CoreParts(salts=TenantSalts(key, cfg.tenants), tickets=ResumeTickets(key),
                     tenants=TenantPolicies(cfg), quotas=Quotas(), queue=FairQueue(), topology=Topology(cfg),
                     usage=usage, registry=registry, pools=PoolManager(cfg, registry),
                     policy=make_policy(cfg.router.placement.policy, policy_seed),
                     telemetry=telemetry, disk=disk,
                     tokenizers=concurrent.futures.ThreadPoolExecutor(cfg.router.api.tokenizer_threads,
                                                                      thread_name_prefix="tokenize"))


def router_health(cfg: ClusterConfig, loop: asyncio.AbstractEventLoop, stop: asyncio.Event):
    """The router's probes (health.router_port): live while its loop answers, ready until it stops."""
    return serve_health(cfg.health.host, cfg.health.router_port,
                        HealthChecks(loop, lambda: None, lambda: "stopping" if stop.is_set() else None))


async def start_grpc(stack: contextlib.AsyncExitStack, cfg: ClusterConfig, tls: TLSMaterial | None,
                     core: RouterCore, jobs: JobService, auth: GrpcCaller,
                     audit: AuditWriter | None) -> tuple[str, str]:
    """Both gRPC listeners serving every service, stopped (2 s grace) when ``stack`` unwinds;
    their addresses (public, internal)."""
    api = cfg.router.api
    # the public listener takes small messages and a bounded number of calls; the internal one, workers'
    # sizes, and the same bounds as the public one on every call but a worker's registration and heartbeats
    public = create_server(max_receive_bytes=api.max_message_bytes, max_concurrent_rpcs=api.max_concurrent_rpcs)
    internal_server = create_server()
    bounds = CallBounds(api.max_message_bytes, api.max_concurrent_rpcs, WORKER_CALLS)
    for server, bound in ((public, None), (internal_server, bounds)):
        add_router_to_server(core, server, auth, audit, bound)
        add_jobs_to_server(jobs, server, bound)
    host = cfg.router.host
    try:
        port = bind(public, host, cfg.router.port, tls)
        internal = bind(internal_server, host, cfg.router.internal_port, tls, mutual=True)
    except OSError as exc:
        raise SystemExit(f"router: {exc}") from None
    await public.start()
    await internal_server.start()
    stack.push_async_callback(lambda: asyncio.gather(public.stop(grace=2.0), internal_server.stop(grace=2.0)))
    return f"{host}:{port}", f"{host}:{internal}"


async def start_http(stack: contextlib.AsyncExitStack, cfg: ClusterConfig, renewal: Renewal,
                     core: RouterCore, auth: CallerAuth) -> str:
    """The OpenAI-compatible HTTP API when enabled (its certificate files in a private folder
    removed at exit, renewed by ``renewal``), naming callers by ``auth`` (gRPC's: one OpenID key
    cache); its address ("" when off)."""
    tls, copies = renewal.copies.tls, renewal.copies
    if cfg.router.http_port is None:
        return ""
    private = Path(stack.enter_context(private_folder()))
    files = copies.write(private / "ca.pem", private / "http.pem", private / "http.key", "HTTPS listener")
    app = OpenAIServer(core, cfg.router.http, tls=tls, auth=auth).app
    http, http_task, http_port = await serve_http(app, cfg.router.host, cfg.router.http_port,
                                                  files[1:] if files else None, cfg.router.http,
                                                  client_ca=files[0] if files else None)
    renewal.http = http

    async def stop() -> None:
        http.should_exit = True
        await asyncio.wait_for(http_task, 5.0)

    stack.push_async_callback(stop)
    return f"{cfg.router.host}:{http_port}"


async def run(args: argparse.Namespace) -> None:
    """The composition root: builds every part in the order they depend on each other and
    tears them down in reverse (one AsyncExitStack) when SIGTERM or SIGINT arrives."""
    cfg = named_router(load_config(args.config), args.name)
    pem = pem_from_env()
    tls = router_tls(cfg, args.name, pem)
    salt_key = read_secret(cfg.kv.secret_file, os.environ.get("KVRELAY_KV_SECRET", ""))
    tok, limits = model_limits(cfg, args)
    async with contextlib.AsyncExitStack() as stack:
        audit = audit_log(cfg)
        if audit is not None:
            stack.callback(audit.close)
        tracing = Tracing(cfg.telemetry, "kvrelay-router", "router", {"kvrelay.site": cfg.router.site or ""},
                          follow_remote=False)  # a client's sampled flag does not force tracing
        stack.callback(tracing.shutdown)
        registry = metrics_registry(cfg, args.name, tls)
        metrics = serve_metrics(registry, cfg.telemetry.metrics_host, cfg.telemetry.router_metrics_port)
        if metrics is not None:
            stack.callback(metrics.close)
        parts = core_parts(cfg, Dialer(tls), salt_key=salt_key, tracing=tracing, metrics=registry,
                           jobs_db=args.jobs_db)
        parts.membership = membership(cfg, tls, parts.registry, parts.pools)
        core = RouterCore(cfg, tok, limits, parts, audit=audit,
                          metrics_address=metrics.advertised(cfg.router.host) if metrics else "")
        stack.push_async_callback(core.aclose)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        health = router_health(cfg, loop, stop)
        if health is not None:
            stack.callback(health.close)
        auth = GrpcCaller(cfg, tls)
        m = parts.membership
        renewal = Renewal(MaterialCopies(tls), parts.registry, etcd=m.client if isinstance(m, EtcdMembership) else None)
        jobs = job_service(cfg, args, core, auth, audit,
                           job_store(cfg, renewal.copies, args, Path(stack.enter_context(private_folder()))))
        stack.push_async_callback(jobs.stop)  # after the listeners stop
        public, internal = await start_grpc(stack, cfg, tls, core, jobs, auth, audit)
        http = await start_http(stack, cfg, renewal, core, auth.auth)
        await join(stack, cfg, core, announced(cfg, args.name, public, internal, http))
        try:  # after etcd: a router that cannot reach it says so first
            await jobs.start()
        except JobStoreUnavailable as exc:
            raise SystemExit(f"router {args.name}: {exc}") from None
        ready = f"READY {public} internal={internal}" + (f" http={http}" if http else "")
        if metrics is not None:
            ready += f" metrics={metrics.address}"
        print(ready + (f" health={cfg.health.host}:{health.port}" if health is not None else ""), flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [(RetentionSweeper(cfg, jobs.store, audit).run(stop), 30.0, "the retention sweep"),
                 (keep_targets(core, cfg.telemetry.prometheus_targets, stop), 5.0, "the Prometheus targets file"),
                 (follow_revocations(args.config, tls.revoked if tls else None, stop, revocations_audited(audit)),
                  5.0, "following the revoked serials"),
                 (follow_material(material_files(cfg.tls, tls_dir_from_env(), pem), tls, stop, renewal),
                  5.0, "following the TLS material")]
        running = [(asyncio.create_task(work), wait_s, what) for work, wait_s, what in tasks]
        await stop.wait()
        for task, wait_s, what in running:
            await _stopped(task, wait_s, what)


def metrics_registry(cfg: ClusterConfig, name: str | None, tls: TLSMaterial | None) -> CollectorRegistry:
    """The router's Prometheus registry, with its certificate's expiry (the request metrics join it later)."""
    registry = CollectorRegistry()
    if tls is not None:
        registry.register(CertificateCollector(tls, {"router": name or "", "site": cfg.router.site or ""}))
    return registry


def private_folder() -> tempfile.TemporaryDirectory:
    """A folder only this process reads (0700), removed at exit: key files for libraries that read files."""
    return tempfile.TemporaryDirectory(prefix="kvrelay-router-")


def job_store(cfg: ClusterConfig, copies: MaterialCopies, args: argparse.Namespace,
              folder: Path) -> str | Callable[[], JobStorage]:
    """Where this router's jobs live: its SQLite file (one router), or what opens the routers'
    PostgreSQL (several; libpq reads the router's certificate, key and CA from ``folder``)."""
    if len(cfg.routers) < 2:
        if not (args.jobs_db or cfg.router.records.jobs_db):
            logging.getLogger(__name__).warning("router.records.jobs_db is not set: batch jobs live in memory only")
        return args.jobs_db or cfg.router.records.jobs_db or ":memory:"
    files = copies.write(folder / "pg-ca.pem", folder / "pg.pem", folder / "pg.key", "jobs database")
    pg = cfg.postgres
    info = conninfo(pg.endpoints, pg.database, pg.user, files)
    return functools.partial(SharedJobStore, info, args.name, ", ".join(pg.endpoints), pg.timeout_s)


def job_service(cfg: ClusterConfig, args: argparse.Namespace, core: RouterCore, auth: GrpcCaller,
                audit: AuditWriter | None, store: str | Callable[[], JobStorage]) -> JobService:
    """The Jobs service over ``store``; with a shared store, it takes back the requests of routers
    that left (the membership says which are live, while etcd answers)."""
    live = None
    if not isinstance(store, str):
        def live() -> frozenset[str] | None:
            m = core.membership
            if isinstance(m, EtcdMembership) and m.lease and m.down_since is None:
                return frozenset(m.routers)
            return None
    return JobService(core, store, cfg.router.admission.job_concurrency, auth, audit, live,
                      float(cfg.etcd.lease_ttl_s))


def membership(cfg: ClusterConfig, tls: TLSMaterial | None, registry: WorkerRegistry,
               pools: PoolManager) -> Membership:
    """How this router shares its workers and pools: through etcd when ``routers:`` lists several (or
    etcd is configured), else not at all."""
    if len(cfg.routers) > 1 or (cfg.routers and cfg.etcd.endpoints):
        client = EtcdClient(cfg.etcd.endpoints, Dialer(tls), cfg.etcd.timeout_s)
        return EtcdMembership(cfg.etcd, client, registry, pools, SharedNames.of(cfg))
    return SoloMembership()


def _audit_refused_value(core: RouterCore, router: str, key: str, revision: int, why: str) -> None:
    """A value of the routers' shared store this router did not apply, in its audit log."""
    if core.audit is not None:
        core.audit.append(RecordKind.SHARED_VALUE, {"router": router, "key": key, "revision": revision,
                                                    "outcome": "not applied", "error": why[:400]})


def announced(cfg: ClusterConfig, name: str | None, public: str, internal: str, http: str) -> ipb.RouterPeer:
    """This router as the others and its clients reach it (``routers[].advertise``, else as bound)."""
    entry = cfg.router_entry(name) if name else None
    reach = entry.reachable if entry is not None else (lambda a: a)
    return ipb.RouterPeer(name=name or "", site=cfg.router.site or "", address=reach(public),
                          internal_address=reach(internal), http_address=reach(http) if http else "")


async def join(stack: contextlib.AsyncExitStack, cfg: ClusterConfig, core: RouterCore, me: ipb.RouterPeer) -> None:
    """Announces this router (listening now) to the others; SystemExit naming etcd when it cannot."""
    site = next((s for s in cfg.sites if s.name == me.site), None)
    me.jurisdiction = site.jurisdiction if site is not None else ""
    if isinstance(core.membership, EtcdMembership):  # each value etcd holds that is not applied, audited
        core.membership.on_refused = functools.partial(_audit_refused_value, core, me.name)
    try:
        await core.membership.start(me)
    except EtcdError as exc:
        await core.membership.aclose()
        raise SystemExit(f"router {me.name}: {exc}") from None
    stack.push_async_callback(core.membership.aclose)
    m = core.membership
    if isinstance(m, EtcdMembership):  # tenants' quotas hold across the routers (router/core/shared_quotas.py)
        exchange = QuotaExchange(m.client, cfg.etcd.prefix, me.name, core.quotas, core.tenants, lambda: m.lease,
                                 core.queue, frozenset(r.name for r in cfg.routers))
        m.on_quotas = exchange.take  # the membership's watch brings the others' figures
        task = asyncio.create_task(exchange.run(), name="quota-exchange")
        stack.push_async_callback(_cancelled, task)


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="router")
    p.add_argument("--config")
    p.add_argument("--name", help="which router of the config's routers: this process is")
    p.add_argument("--model-path", required=True)
    p.add_argument("--model-name", help="name clients use (default: the checkpoint folder's name)")
    p.add_argument("--jobs-db", help="SQLite file for batch jobs (overrides router.records.jobs_db)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s router %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    asyncio.run(run(args))
    return 0
