"""The launcher: the router as a process on this machine, and every worker
through a backend: processes here (:class:`LocalBackend`), or Ray actors on
the nodes of each site (``launch/ray_backend.py``).

After start, a reconciler keeps each pool at the size the router holds
(``kvrelay scale`` changes it): it starts workers when a pool is short
(scale-up, or a worker that died) and reaps the ones that leave after a
drain. ``stop()`` (and Ctrl-C / SIGTERM in ``kvrelay serve``) ends all of
them; local children also get SIGTERM from the kernel if the launcher itself
dies (PR_SET_PDEATHSIG, which each child sets itself: runtime/lifetime.py),
so nothing is orphaned."""

from __future__ import annotations

import copy
import logging
import os
import secrets
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

import grpc

from kvrelay.launch.cities import CitiesState
from kvrelay.launch.credentials import AUDIT_KEY, LOCAL_TENANT, ClusterCredentials, ensure_audit_key
from kvrelay.launch.etcd import EtcdCluster
from kvrelay.launch.postgres import PostgresCluster
from kvrelay.launch.renewal import CertKeeper
from kvrelay.launch.routers import Ready, port_of, router_config, start_etcd, start_postgres
from kvrelay.launch.zygote import shared_zygote
from kvrelay.router.core.auth import token_sha256
from kvrelay.runtime.config import (
    ClusterConfig,
    ConfigError,
    Credential,
    PoolSection,
    RouterEntrySection,
    dump_config,
    load_config,
)
from kvrelay.runtime.engines import EngineKind, pool_engine_problem
from kvrelay.runtime.files import file_stamp, private_folder
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.runtime.roles import Role
from kvrelay.runtime.rpc import Dialer
from kvrelay.runtime.tenants import TenantSection
from kvrelay.runtime.tls import TLSMaterial, parse_serials, router_identity
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 0.5
ROUTER_START_TIMEOUT_S = 180.0
"""What start() allows at least (the routers' start); more where a pool's start_timeout_s is longer."""


class WorkerProc(Protocol):
    """A running worker as its backend knows it (subprocess.Popen fits)."""

    pid: int

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


class RouterProc(WorkerProc, Protocol):
    """A router a backend runs at its site: also its output, line by line (its READY line)."""

    def readline(self, timeout: float) -> str: ...


class WorkerBackend(Protocol):
    """Starts worker processes (``python -m <module> <args>``) at a site."""

    def start(self, name: str, module: str, args: list[str], site: str, env: dict[str, str], *,
              preload_vllm: bool = False) -> WorkerProc:
        """Starts a worker; ``preload_vllm``: it runs vLLM on the CPU (a backend may import vLLM ahead)."""
        ...
    def start_router(self, name: str, args: list[str], site: str, env: dict[str, str]) -> RouterProc | None:
        """One of several routers (``python -m kvrelay.router <args>``) at ``site``; None: the
        launcher runs routers itself, on its own machine."""
        ...
    def close(self) -> None: ...


class LocalBackend:
    """Workers as processes on this machine: forked from a preloaded zygote
    (launch/zygote.py, ``fork=True``), or started as ``python -m <module>``;
    always the latter inside a site's network namespace when ``cities`` (a
    ``kvrelay cities up`` emulation) is given."""

    def __init__(self, cities: CitiesState | None = None, fork: bool = True) -> None:
        self.cities = cities
        self.fork = fork and cities is None

    def start(self, name: str, module: str, args: list[str], site: str, env: dict[str, str], *,
              preload_vllm: bool = False) -> WorkerProc:
        if self.fork:
            return shared_zygote().start(module, args, {**os.environ, **env}, preload_vllm=preload_vllm)
        prefix: list[str] = []
        if self.cities is not None:
            # `ip netns exec` execs in place: same pid, so signals and PDEATHSIG reach the worker
            prefix = self.cities.exec_prefix(site)
            args = [*args, "--host", self.cities.site(site).site_addr]
        # no preexec_fn (unsafe in a threaded launcher): the worker asks for PDEATHSIG itself
        return subprocess.Popen([*prefix, sys.executable, "-m", module, *args], env={**os.environ, **env})

    def start_router(self, name: str, args: list[str], site: str, env: dict[str, str]) -> RouterProc | None:
        """None: routers run as the launcher's own children."""
        return None

    def close(self) -> None:
        pass


def _line_reader(out: IO[str] | None) -> Callable[[float], str]:
    """``readline(timeout)`` over a process's piped stdout."""
    if out is None:  # started with its stdout a pipe
        raise RuntimeError("the router's stdout is not a pipe")

    def readline(timeout: float) -> str:
        return out.readline() if select.select([out], [], [], timeout)[0] else ""
    return readline


@dataclass(slots=True)
class Child:
    name: str
    proc: WorkerProc
    site: str = ""
    role: str = ""
    started: float = field(default_factory=time.monotonic)
    seen: bool = False
    """The worker registered (it counts as a member of its pool from then on)."""
    stdout: IO[str] | None = None
    """The router's stdout (its READY line); None for a worker."""


def refuse_engines_this_host_cannot_run(cfg: ClusterConfig) -> None:
    """ValueError naming the first pool whose engine cannot run on this host (vLLM missing, or its
    CPU build for a pool on a GPU)."""
    transport = cfg.kv.transport  # auto never chooses local
    for i, site in enumerate(cfg.sites):
        for role in Role:
            pool = site.pool(role)
            problem = pool_engine_problem(pool, f"sites[{i}].{role} ({site.name})", transport,
                                          pool.device or cfg.model.device)
            if problem is not None:
                raise ValueError(problem)


def _any_free_ports(cfg: ClusterConfig) -> None:
    """Every router listener on a free port (``router.port: 0`` says so for all of them)."""
    cfg.router.internal_port = 0
    if cfg.router.http_port is not None:
        cfg.router.http_port = 0
    for r in cfg.routers:
        r.port = r.internal_port = 0
        r.http_port = None if r.http_port is None else 0


class LocalCluster:
    def __init__(self, cfg: ClusterConfig, model_path: str | Path, log_level: str = "WARNING",
                 cities: CitiesState | None = None, backend: WorkerBackend | None = None,
                 reconcile: bool = True, config_file: str | Path | None = None) -> None:
        """``cities``: run each site's workers inside its namespace of a
        ``kvrelay cities up`` emulation (the router listens on its gateway).
        ``backend``: where workers run (default: processes here).
        ``reconcile``: keep pools at their desired size (replace dead workers,
        follow ``kvrelay scale``); tests that kill workers on purpose turn it off.
        ``config_file``: the file ``cfg`` came from, whose ``tls.revoked_serials`` the launcher
        follows into the copies its processes read (they follow those: runtime/revocations.py).
        The launcher works on its own copy of ``cfg`` (``self.cfg``)."""
        cfg = copy.deepcopy(cfg)  # it adds its credential, a jobs database, the router address
        if backend is None:  # the workers run here: their engines must
            refuse_engines_this_host_cannot_run(cfg)
        if cities is not None and (mismatch := cities.matches(cfg)):
            raise ValueError(f"the emulated cities do not fit this config: {mismatch}")
        if cfg.router.port == 0:  # any free port for gRPC: the same for the others (tests, benchmarks)
            _any_free_ports(cfg)
        self.cfg, self.model_path, self.log_level = cfg, Path(model_path), log_level
        self.cities = cities
        self.backend = backend or LocalBackend(cities)
        self.reconcile_pools = reconcile
        self.children: list[Child] = []
        self.left: list[Child] = []
        """Workers that exited (drained, or died); kept for status and tests."""
        self.router_address = ""
        """host:port of the router's public gRPC listener (TLS, bearer tokens)."""
        self.internal_address = ""
        """host:port of its mutual-TLS listener (workers, certificate holders)."""
        self.http_address = ""
        """host:port of the router's OpenAI-compatible HTTP API ("" when turned off)."""
        self.metrics_address = ""
        """host:port of the router's /metrics ("" when off)."""
        self.routers: dict[str, Ready] = {}
        """Where each router listens, by name ("" for the single one); the addresses above: the first's."""
        self.etcd: EtcdCluster | None = None  # the routers' etcd and job database, when started here (several
        self.postgres: PostgresCluster | None = None  # routers, and no etcd.endpoints or postgres.endpoints)
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrelay-")
        """The launcher's own files: the jobs database, the CA of this run."""
        self._router_tmp: tempfile.TemporaryDirectory | None = None
        """The router's records when it runs as the invoking user of sudo (--cities): that user's folder."""
        self._worker_tmp = tempfile.TemporaryDirectory(prefix="kvrelay-workers-")
        """What the workers read (the config): readable by unprivileged workers under --cities."""
        self.config_path = Path(self._worker_tmp.name) / "cluster.yaml"
        if cities is not None:
            cities.share_with_workers(Path(self._worker_tmp.name))
        self._default_records(cfg)
        self._secret = secrets.token_hex(32)
        """Per-run KV secret for the workers when the config names no secret file."""
        self.creds = ClusterCredentials.for_config(cfg.tls, Path(self._tmp.name) / "ca")
        """Issues each process its certificate (None: tls.enabled false)."""
        self.keeper = self._keeper()
        """Renews each local process's certificate (None: TLS off, or the processes run elsewhere)."""
        self._add_run_tokens(cfg)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_index: dict[tuple[str, str], int] = {}
        self._config_file = Path(config_file) if config_file is not None else None
        self._config_stamp = file_stamp(Path(config_file)) if config_file is not None else None

    def _default_records(self, cfg: ClusterConfig) -> None:
        """The router's records the config names no file for: in this run's folder (durable across
        router restarts, for this cluster's life), and the key that signs the audit log's heads."""
        records, rec = self._records_folder(), cfg.router.records
        if rec.jobs_db is None:
            rec.jobs_db = str(records / "jobs.sqlite")
        if rec.audit_log is None:
            rec.audit_log = str(records / "audit" / "audit.jsonl")
        if rec.usage_db is None:
            rec.usage_db = str(records / "usage.sqlite")
        self._audit_key(cfg)

    def _audit_key(self, cfg: ClusterConfig) -> None:
        """A key that signs the audit log's heads when the config names none: ``keys/`` beside
        the log, made on first use (under --cities, the unprivileged router's own)."""
        rec = cfg.router.records
        if rec.audit_signing_key is not None or not rec.audit_log:
            return
        folder = Path(rec.audit_log).parent / "keys"
        made = not (folder / AUDIT_KEY).exists()
        key = ensure_audit_key(folder)
        rec.audit_signing_key = str(key)
        if made and self.cities is not None and not self.cities.worker_drop().keeps_root_uid:
            drop = self.cities.worker_drop()
            for p in (folder, key, key.with_name(key.name + ".pub")):
                os.chown(p, drop.uid, drop.gid)

    def _records_folder(self) -> Path:
        """Where this run keeps the router's records when the config names none: the launcher's
        own folder, or, when the router runs as the invoking user of sudo (--cities), a folder
        of that user's (0700)."""
        if self.cities is None or self.cities.worker_drop().keeps_root_uid:
            return Path(self._tmp.name)
        drop = self.cities.worker_drop()
        tmp = self._router_tmp = tempfile.TemporaryDirectory(prefix="kvrelay-router-")
        os.chown(tmp.name, drop.uid, drop.gid)
        return Path(tmp.name)

    def _add_run_tokens(self, cfg: ClusterConfig) -> None:
        """This run's tokens: tenant ``local``'s when the config lists no
        clients (nor allows anonymous ones); the launcher's own operator token
        (reading pool sizes), which is the operators' one when none are listed."""
        self.client_token = ""
        """The token of tenant ``local`` ("" when the config lists clients)."""
        if not cfg.tenants and not cfg.auth.allow_anonymous:
            self.client_token = secrets.token_urlsafe(32)
            cfg.tenants.append(TenantSection(LOCAL_TENANT, token_sha256(self.client_token)))
        self._launcher_token = secrets.token_urlsafe(32)
        self.operator_token = "" if cfg.auth.operators else self._launcher_token
        """Bearer token for the Admin API when the config lists no operators ("" otherwise)."""
        cfg.auth.operators.append(Credential("kvrelay-launcher", token_sha256(self._launcher_token)))

    def _keeper(self) -> CertKeeper | None:
        """The keeper of the processes' certificates, in a folder local workers can enter (owned by
        the user they run as under --cities)."""
        if self.creds is None:
            return None
        root = Path(self._worker_tmp.name) / "tls"
        private_folder(root)
        if self._child_owner is not None:
            os.chown(root, *self._child_owner)
        return CertKeeper(self.creds, root)

    @property
    def _child_owner(self) -> tuple[int, int] | None:
        """The uid and gid the router and workers run as, when not this launcher's (--cities)."""
        if self.cities is None or self.cities.worker_drop().keeps_root_uid:
            return None
        drop = self.cities.worker_drop()
        return drop.uid, drop.gid

    def _env(self, name: str, ident: Identity, hosts: tuple[str, ...] = (), remote: bool = False) -> dict[str, str]:
        """A child's secrets: the KV secret (unless the config names a file) and its certificate
        (in a folder here the launcher renews it in; ``remote``: a process its backend starts on
        another node, handed the certificate in its environment, its actor taking renewals)."""
        env = {} if self.cfg.kv.secret_file else {"KVRELAY_KV_SECRET": self._secret}
        if self.keeper is not None and remote:
            env |= self.keeper.issue_remote(name, ident, hosts)
        elif self.keeper is not None:
            env |= self.keeper.issue(name, ident, hosts, self._child_owner)
        return env

    def _started(self, name: str, proc: WorkerProc) -> WorkerProc:
        """``proc``, started with :meth:`_env`'s certificate: renewals reach it through its actor when it has one."""
        deliver = getattr(proc, "write_tls", None)
        if self.keeper is not None and deliver is not None:
            self.keeper.attach(name, deliver)
        return proc

    # -- how callers reach this cluster ---------------------------------------
    @property
    def ca_file(self) -> Path | None:
        """The CA bundle clients verify the router by (for `kvrelay --ca`); None with TLS off."""
        if self.creds is None:
            return None
        path = Path(self._tmp.name) / "clients-ca.pem"
        if not path.exists():
            path.write_bytes(self.creds.ca_pem)
        return path

    @property
    def client_tls(self) -> TLSMaterial | None:
        """What a client needs to verify the router (the CA); None with TLS off."""
        return self.creds.client() if self.creds is not None else None

    def dialer(self, token: str | None = None) -> Dialer:
        """Channels to this cluster that send ``token`` (None: no token)."""
        return Dialer(self.client_tls, token)

    @property
    def client_dialer(self) -> Dialer:
        """Channels as tenant ``local`` (or with no token when the config lists clients)."""
        return self.dialer(self.client_token or None)

    @property
    def operator_dialer(self) -> Dialer:
        """Channels with the launcher's operator token (Admin API, ListWorkers)."""
        return self.dialer(self._launcher_token)

    def channel(self, operator: bool = False):
        """A blocking channel to the router's public listener, as tenant
        ``local`` or (``operator``) with the operator token."""
        return (self.operator_dialer if operator else self.client_dialer).sync(self.router_address)

    @property
    def kv_secret(self) -> bytes:
        """The KV secret this run's workers prove (tests that act as a KV peer)."""
        return self._secret.encode()

    def router_dialer(self) -> Dialer:
        """Channels that present a router certificate: what workers admit (tests of the workers)."""
        if self.creds is None:
            return Dialer()
        # a router's own identity: workers admit no other router certificate
        ident = Identity.parse(self.cfg.router_uris[0])
        assert ident is not None  # the config checks every router's name and site
        return Dialer(self.creds.material(ident))

    def worker_channel(self, info):
        """A blocking channel to a worker (``WorkerInfo``) as the router makes it."""
        site, role, name = info.worker_id.split("/")
        return self.router_dialer().sync(info.address, server_name=Identity(site, CertRole(role), name).dns)

    @property
    def addresses(self) -> str:
        """Every router's public address, comma-separated (what `kvrelay generate --router` and a replay take)."""
        return ",".join(r.address for r in self.routers.values()) or self.router_address

    def router_for(self, site: str) -> str:
        """The internal address a worker of ``site`` registers at: its site's router, else the first."""
        here = next((r.name for r in self.cfg.routers if r.site == site and r.name in self.routers), None)
        return self.routers[here].internal if here is not None else self.internal_address

    def _start_worker(self, site: str, role: str) -> Child:
        i = self._next_index.get((site, role), 0)
        self._next_index[(site, role)] = i + 1
        name = f"{site}/{role}/{i}"
        args = ["--config", str(self.config_path), "--model-path", str(self.model_path),
                "--router", self.router_for(site), "--site", site, "--index", str(i), "--log-level", self.log_level]
        env = self._env(name, Identity(site, CertRole(role), str(i)), remote=not isinstance(self.backend, LocalBackend))
        pool = self._pool(site, role)
        vllm_cpu = pool.engine is EngineKind.VLLM and (pool.device or self.cfg.model.device) == "cpu"
        proc = self.backend.start(name, f"kvrelay.{role}_worker", args, site, env, preload_vllm=vllm_cpu)
        child = Child(name, self._started(name, proc), site, role)
        with self._lock:
            self.children.append(child)
        return child

    def _pool(self, site: str, role: str) -> PoolSection:
        return next(s for s in self.cfg.sites if s.name == site).pool(Role(role))

    def start(self, timeout_s: float | None = None) -> str:
        """Starts everything; returns the router address once every worker registered, within
        ``timeout_s`` (None: the slowest started pool's start_timeout_s, ROUTER_START_TIMEOUT_S at least)."""
        if timeout_s is None:
            timeout_s = max([ROUTER_START_TIMEOUT_S, *(s.pool(r).start_timeout() for s in self.cfg.sites
                                                       for r in Role if s.pool(r).replicas)])
        shared_host = "127.0.0.1"
        if self.cities is not None:  # the router on the bridge; several: each in its city, etcd and PostgreSQL
            self.cfg.router.host = shared_host = self.cities.gateway  # on the bridge, which every city reaches
            for r in self.cfg.routers:
                r.host = self.cities.site(r.site).site_addr
        self.etcd = start_etcd(self.cfg, self.creds, Path(self._tmp.name) / "etcd", host=shared_host,
                               keeper=self.keeper)
        try:
            self.postgres = start_postgres(self.cfg, self.creds, host=shared_host, keeper=self.keeper)
        except BaseException:
            if self.etcd is not None:
                self.etcd.stop()
            raise
        dump_config(self.cfg, self.config_path)
        if self.cities is not None:
            self.cities.share_with_workers(self.config_path)
            self.cities.check_worker_access([sys.executable, self.model_path, self.config_path,
                                             *([self.cfg.kv.secret_file] if self.cfg.kv.secret_file else [])])
        deadline = time.monotonic() + timeout_s
        try:
            entries: list[RouterEntrySection | None] = [*self.cfg.routers] or [None]
            for entry in entries:
                self._start_router(deadline, entry)
            expected = 0
            for site in self.cfg.sites:
                for role in Role:
                    for _ in range(site.pool(role).replicas):
                        self._start_worker(site.name, role)
                        expected += 1
            self._await_workers(expected, deadline)
        except BaseException:
            self.stop()
            raise
        if self.reconcile_pools:
            self._thread = threading.Thread(target=self._reconcile_loop, name="pool-reconciler", daemon=True)
            self._thread.start()
        if self.keeper is not None:
            self.keeper.start(self.follow_revocations)
        return self.router_address

    def follow_revocations(self) -> bool:
        """The config file's ``tls.revoked_serials`` into the copies the router and workers read,
        when the file changed (True then); a config that does not load is logged and changes nothing."""
        if self._config_file is None or self.creds is None:
            return False
        stamp = file_stamp(self._config_file)
        if stamp is None or stamp == self._config_stamp:
            return False
        self._config_stamp = stamp
        try:
            serials = load_config(self._config_file).tls.revoked_serials
        except (ConfigError, OSError) as exc:
            log.error("%s changed but does not load (%s): the revoked serials stay as they were",
                      self._config_file, exc)
            return False
        if serials == self.cfg.tls.revoked_serials:
            return False
        added = parse_serials(serials) - self.creds.revoked
        self.cfg.tls.revoked_serials = list(serials)
        self.creds.revoked = parse_serials(serials)
        self._revoke_at_stores(added)
        dump_config(self.cfg, self.config_path)
        for entry in self.cfg.routers:
            if entry.name in self.routers:
                dump_config(router_config(self.cfg, entry, self.routers[entry.name]), self._router_config(entry))
        log.warning("tls.revoked_serials changed in %s: passed on to the router and workers", self._config_file)
        return True

    def _revoke_at_stores(self, added: frozenset[int]) -> None:
        """The revoked serials to the routers' etcd and PostgreSQL: a new revocation list in each
        server's folder (PostgreSQL reloads it, etcd reads it at each handshake), then, for serials
        newly revoked, the sessions they hold ended (PostgreSQL's backends; etcd's members restarted
        one at a time), so a revoked router certificate keeps no connection either."""
        if self.keeper is not None:
            self.keeper.revoked_changed()
        if not added:
            return
        if self.postgres is not None:
            try:
                ended = self.postgres.cut_revoked(self.creds.revoked if self.creds else frozenset())
                log.warning("ended %d PostgreSQL session(s) of revoked certificates", ended)
            except RuntimeError as exc:
                log.error("could not end the PostgreSQL sessions of revoked certificates: %s", exc)
        ident = Identity.parse(self.cfg.routers[0].uri) if self.cfg.routers else None
        if self.etcd is not None and self.creds is not None and ident is not None:
            try:
                self.etcd.cut_connections(Dialer(self.creds.material(ident)))
                log.warning("etcd's members restarted one at a time: connections of revoked certificates ended")
            except RuntimeError as exc:
                log.error("could not end etcd's connections of revoked certificates: %s", exc)

    def _start_router(self, deadline: float, entry: RouterEntrySection | None = None) -> None:
        """Starts the router (``entry``: router ``entry.name`` of ``routers:``) and waits for its READY line."""
        host = entry.host if entry is not None else self.cfg.router.host
        extra = (entry.advertise,) if entry is not None and entry.advertise else ()
        hosts = tuple(dict.fromkeys((host, *extra, "localhost", "127.0.0.1", *self.cfg.tls.server_names)))
        ident = Identity.parse(entry.uri) if entry is not None else router_identity(self.cfg)
        if ident is None:  # the config checks each router's name and site
            raise ValueError(f"router {entry.name if entry else ''} names no router identity")
        name = entry.name if entry is not None else ""
        child = f"router/{name}" if name else "router"
        env = self._env(child, ident, hosts, remote=entry is not None and not isinstance(self.backend, LocalBackend))
        config, named = self.config_path, []
        if entry is not None:
            config = self._router_config(entry)
            dump_config(router_config(self.cfg, entry, self.routers.get(entry.name)), config)
            named = ["--name", entry.name]
        args = ["--config", str(config), "--model-path", str(self.model_path), "--log-level", self.log_level, *named]
        actor = self.backend.start_router(child, args, entry.site, env) if entry is not None else None
        if actor is not None:
            self._started(child, actor)  # at its site, as the backend runs it (Ray: an actor on a node of the site)
            with self._lock:
                self.children.append(Child(child, actor))
            ready = self.routers[name] = self._await_ready(actor, actor.readline, deadline)
        else:
            prefix: list[str] = []
            if self.cities is not None:  # it parses network input: no root, as the workers (launch/privileges.py)
                rec = self.cfg.router.records
                self.cities.check_router_writes([p for p in (rec.jobs_db, rec.audit_log, rec.usage_db) if p])
                # one of several: in its city's namespace (it reaches other cities' workers over the links)
                prefix = (self.cities.exec_prefix(entry.site) if entry is not None
                          else list(self.cities.worker_drop().prefix))
            router: WorkerProc
            if not prefix and isinstance(self.backend, LocalBackend) and self.backend.fork:
                router = forked = shared_zygote().start("kvrelay.router", args, {**os.environ, **env}, stdout=True)
                out = forked.stdout
            else:
                router = popen = subprocess.Popen([*prefix, sys.executable, "-m", "kvrelay.router", *args],
                                                  env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
                out = popen.stdout
            with self._lock:
                self.children.append(Child(child, router, stdout=out))
            ready = self.routers[name] = self._await_ready(router, _line_reader(out), deadline)
        if entry is None or entry is self.cfg.routers[0]:
            self.router_address, self.internal_address = ready.address, ready.internal
            self.http_address, self.metrics_address = ready.http, ready.metrics

    def _router_config(self, entry: RouterEntrySection) -> Path:
        """The config file router ``entry`` reads (one of several)."""
        return Path(self._worker_tmp.name) / f"router-{entry.name}.yaml"

    def stop_router(self, name: str = "", kill: bool = True) -> None:
        """Stops router ``name`` ("": the single router) with SIGKILL (or SIGTERM with ``kill=False``)."""
        with self._lock:
            old = next((c for c in self.children if c.name == (f"router/{name}" if name else "router")), None)
            if old is None:  # stopped already
                return
            self.children.remove(old)
        (old.proc.kill if kill else old.proc.terminate)()
        old.proc.wait(30)
        if old.stdout is not None:
            old.stdout.close()

    def restart_router(self, kill: bool = True, timeout_s: float = 60.0, name: str = "") -> None:
        """Stops the router (SIGKILL, or SIGTERM with ``kill=False``) and starts
        it again on the same address; workers register with it again on their
        next heartbeat, and it resumes unfinished batch jobs from its database.
        ``name``: which of ``routers:`` (it keeps its ports)."""
        self.stop_router(name, kill)
        entry = self.cfg.router_entry(name) if name else None
        if entry is not None:
            self._start_router(time.monotonic() + timeout_s, entry)
            return
        r = self.cfg.router
        r.port, r.internal_port = port_of(self.router_address), port_of(self.internal_address)
        if self.http_address:
            r.http_port = port_of(self.http_address)
        if self.metrics_address:  # a restarted router serves /metrics where Prometheus looks
            self.cfg.telemetry.router_metrics_port = port_of(self.metrics_address)
        dump_config(self.cfg, self.config_path)
        self._start_router(time.monotonic() + timeout_s)

    def _await_ready(self, proc: WorkerProc, readline: Callable[[float], str], deadline: float) -> Ready:
        """The router's READY line (``readline(timeout)``: its next line of output, "" when none came)."""
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"router exited with code {code} before it was ready")
            if (addresses := Ready.parse(readline(0.5))) is not None:
                return addresses
        raise TimeoutError("router did not become ready in time")

    def _await_workers(self, expected: int, deadline: float) -> None:
        """Until every router sees ``expected`` healthy workers."""
        for ready in self.routers.values():
            self._await_workers_at(ready.address, expected, deadline)

    def _await_workers_at(self, address: str, expected: int, deadline: float) -> None:
        with self.operator_dialer.sync(address) as ch:
            stub = wgrpc.RegistryStub(ch)
            while time.monotonic() < deadline:
                dead = self.dead_children()
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited with code {dead[0].proc.poll()} during startup")
                try:
                    resp = stub.ListWorkers(wpb.ListWorkersRequest(), timeout=2.0)
                    if sum(w.healthy for w in resp.workers) >= expected:
                        registered = {w.info.worker_id for w in resp.workers}
                        for c in self.children:
                            c.seen = c.seen or c.name in registered
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"workers did not all register within the deadline ({expected} expected)")

    # -- keeping pools at their desired size --------------------------------
    def _reconcile_loop(self) -> None:
        with self.channel(operator=True) as ch:
            admin, registry = agrpc.AdminStub(ch), wgrpc.RegistryStub(ch)
            while not self._stop.wait(RECONCILE_INTERVAL_S):
                try:
                    pools = admin.ListPools(apb.ListPoolsRequest(), timeout=5.0).pools
                    workers = registry.ListWorkers(wpb.ListWorkersRequest(), timeout=5.0).workers
                except grpc.RpcError as exc:
                    log.debug("router unreachable for reconciling: %s", exc.code())
                    continue
                self.reconcile_once(pools, workers)

    def reconcile_once(self, pools, workers) -> list[str]:
        """One pass: reap exited workers, kill ones that never registered,
        start workers where a pool is short. Returns the names started."""
        registered = {w.info.worker_id for w in workers}
        draining = {w.info.worker_id for w in workers if w.draining}
        now = time.monotonic()
        with self._lock:
            for c in self.children:
                c.seen = c.seen or c.name in registered
            for c in [c for c in self.children if c.role and c.proc.poll() is not None]:
                self.children.remove(c)
                self.left.append(c)
                if self.keeper is not None:
                    self.keeper.forget(c.name)
                how = "left after draining" if c.proc.poll() == 0 else f"exited with code {c.proc.poll()}"
                (log.info if c.proc.poll() == 0 else log.warning)("%s %s", c.name, how)
            for c in self.children:
                limit = self._pool(c.site, c.role).start_timeout() if c.role else 0.0
                if c.role and not c.seen and now - c.started > limit:
                    log.warning("%s did not register within %.0f s (its pool's start_timeout_s); stopping it",
                                c.name, limit)
                    c.proc.kill()
            # a pool's members: our live children of it that are not draining (registered or
            # still starting), plus active workers someone else started
            ours = {c.name for c in self.children if c.role}
            have: dict[tuple[str, str], int] = {}
            for c in self.children:
                if c.role and c.proc.poll() is None and c.name not in draining:
                    have[(c.site, c.role)] = have.get((c.site, c.role), 0) + 1
        started = []
        for p in pools:
            n = have.get((p.site, p.role), 0) + sum(1 for w in p.workers if w not in ours)
            for _ in range(max(0, p.desired - n)):
                child = self._start_worker(p.site, p.role)
                log.info("%s/%s has %d of %d: started %s", p.site, p.role, n, p.desired, child.name)
                started.append(child.name)
        return started

    def live_workers(self, role: str) -> list[Child]:
        """Running workers of ``role`` that have registered with the router."""
        with self._lock:
            return [c for c in self.children if c.role == role and c.seen and c.proc.poll() is None]

    def dead_children(self) -> list[Child]:
        with self._lock:
            return [c for c in self.children if c.proc.poll() is not None]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to workers, then the router; SIGKILL whatever is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        if self.keeper is not None:
            self.keeper.stop()
        with self._lock:
            workers = [c for c in self.children if not c.name.startswith("router")]
            routers = [c for c in self.children if c.name.startswith("router")]
        for group in (workers, routers):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.terminate()
            end = time.monotonic() + timeout_s
            for c in group:
                try:
                    c.proc.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", c.name)
                    c.proc.kill()
                    c.proc.wait(10.0)
        for c in routers:
            if c.stdout:
                c.stdout.close()
        if self.etcd is not None:
            self.etcd.stop()
        if self.postgres is not None:
            self.postgres.stop()
        for c in workers + self.left:  # shared-memory KV of workers that could not clean up
            for f in Path("/dev/shm").glob(f"kvrelay-*-{c.proc.pid}"):
                f.unlink(missing_ok=True)
        self.children.clear()
        self.backend.close()
        self._tmp.cleanup()
        self._worker_tmp.cleanup()
