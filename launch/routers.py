"""What a launcher needs to run a deployment's routers: the addresses a router
announces when ready, each router's own config (its records in files of its
own, several routers sharing one machine), and the etcd and PostgreSQL they
share when the config lists several and names none."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from kvrelay.launch.credentials import ClusterCredentials
from kvrelay.launch.etcd import EtcdCluster
from kvrelay.launch.postgres import PostgresCluster
from kvrelay.launch.renewal import CertKeeper
from kvrelay.runtime.config import ClusterConfig, RouterEntrySection
from kvrelay.runtime.pki import Identity
from kvrelay.runtime.rpc import Dialer


@dataclass(frozen=True, slots=True)
class Ready:
    """A router's ``READY`` line: where it listens."""

    address: str
    """host:port of its public gRPC listener."""
    internal: str
    """host:port of its mutual-TLS listener (workers)."""
    http: str = ""
    metrics: str = ""

    @classmethod
    def parse(cls, line: str) -> Ready | None:
        """The addresses of ``READY host:port internal=... [http=...] [metrics=...]``; None for another line."""
        if not line.startswith("READY "):
            return None
        fields = line.split()
        named = dict(f.split("=", 1) for f in fields[2:] if "=" in f)
        return cls(fields[1], named["internal"], named.get("http", ""), named.get("metrics", ""))


def _own(path: str | None, name: str) -> str | None:
    """``path`` with the router's name before its suffix (records.sqlite -> records.<name>.sqlite)."""
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{name}{p.suffix}"))


def router_config(cfg: ClusterConfig, entry: RouterEntrySection, ready: Ready | None = None) -> ClusterConfig:
    """The config router ``entry`` runs with on a machine it shares with the others: its own
    jobs, audit, audit heads and usage files; ``ready``: where it listened before (a restart keeps its ports)."""
    out = copy.deepcopy(cfg)
    rec = out.router.records
    rec.jobs_db, rec.audit_log, rec.usage_db = (_own(rec.jobs_db, entry.name), _own(rec.audit_log, entry.name),
                                                _own(rec.usage_db, entry.name))
    rec.audit_heads = _own(rec.audit_heads, entry.name)
    if ready is not None:
        mine = next(r for r in out.routers if r.name == entry.name)
        mine.port, mine.internal_port = port_of(ready.address), port_of(ready.internal)
        if ready.http:
            mine.http_port = port_of(ready.http)
        if ready.metrics:
            out.telemetry.router_metrics_port = port_of(ready.metrics)
    return out


def port_of(address: str) -> int:
    """The port of ``host:port``."""
    return int(address.rpartition(":")[2])


def start_etcd(cfg: ClusterConfig, creds: ClusterCredentials | None, folder: Path, timeout_s: float = 30.0,
               host: str = "127.0.0.1", keeper: CertKeeper | None = None) -> EtcdCluster | None:
    """etcd for the routers when the config lists several and names no etcd (``etcd.members`` on
    ``host``, certificates from ``creds``, renewed by ``keeper``); fills in ``cfg.etcd.endpoints``. None
    when not needed."""
    if len(cfg.routers) < 2 or cfg.etcd.endpoints:
        return None
    site = cfg.routers[0].site
    etcd = EtcdCluster(cfg.etcd.members, folder, creds, site, host, keeper)
    ident = Identity.parse(cfg.routers[0].uri)
    dialer = Dialer(creds.material(ident)) if creds is not None and ident is not None else Dialer()
    endpoints = etcd.start(dialer, timeout_s)
    if creds is not None:  # only the routers' certificates may use it (issue 56, finding 2)
        try:
            etcd.secure(dialer, cfg.etcd.prefix, [i for r in cfg.routers if (i := Identity.parse(r.uri)) is not None])
        except BaseException:
            etcd.stop()
            raise
    cfg.etcd.endpoints = endpoints
    return etcd


def start_postgres(cfg: ClusterConfig, creds: ClusterCredentials | None, timeout_s: float = 60.0,
                   host: str = "127.0.0.1", keeper: CertKeeper | None = None) -> PostgresCluster | None:
    """The routers' job database when the config lists several and names none (a primary and
    ``postgres.standbys`` on ``host``, certificates from ``creds``, renewed by ``keeper``); fills in
    ``cfg.postgres.endpoints``. None when not needed."""
    if len(cfg.routers) < 2 or cfg.postgres.endpoints:
        return None
    pg = PostgresCluster(cfg.postgres.standbys, creds, cfg.routers[0].site, cfg.postgres.database, cfg.postgres.user,
                         host, keeper)
    cfg.postgres.endpoints = pg.start(timeout_s)
    return pg
