"""The deployment as the data-handling statement (router/governance/statement.py) sees
it: a snapshot of the live state (:class:`DeploymentState`, from the
registry), every pool configured and live, and where each tenant's
requests may run (:class:`Reach`).

Reach follows placement's hard constraints (router/placement/place.py): the pools
in the tenant's jurisdictions that are open to it (not dedicated to other
tenants) and have replicas or live workers. A decode pool always counts; a
prefill pool only when a link joins it to such a decode pool, and KV crosses
exactly those links. Pure functions of the config and the snapshot; the
snapshot (:func:`deployment_state`) is where the disk is read: the modes of
the router's files (:func:`file_states`)."""

from __future__ import annotations

import importlib.metadata
import os
import stat
import time
from dataclasses import dataclass, field

from kvrelay.router.cluster.registry import WorkerRegistry
from kvrelay.router.core.auth import ANONYMOUS
from kvrelay.router.core.tenancy import TenantPolicies
from kvrelay.runtime.config import ClusterConfig, LinkSection
from kvrelay.runtime.roles import Role
from kvrelay.runtime.tenants import TenantSection
from kvrelay.runtime.topology import LOCAL_LINK, Topology, link_name


@dataclass(frozen=True, slots=True)
class LiveWorker:
    """One registered worker as the registry sees it."""

    worker_id: str
    site: str
    role: Role
    device: str = ""
    healthy: bool = True
    draining: bool = False
    transport: str = ""
    """The KV transport it registered with (tcp, nixl, local)."""
    model: str = ""


@dataclass(frozen=True, slots=True)
class LinkState:
    """What the workers' probes say about one link between two sites."""

    up: bool = True
    reason: str = ""
    """Why it is down ("" when up)."""


@dataclass(frozen=True, slots=True)
class FileState:
    """One of the router's files as the router read it on disk (``os.stat``)."""

    path: str
    mode: int | None = None
    """Its permission bits (e.g. 0o600); None: not read (``error`` says why)."""
    owner_uid: int | None = None
    folder: str = ""
    """The folder that holds it."""
    folder_mode: int | None = None
    """The folder's permission bits; None: not read (``folder_error`` says why)."""
    error: str = ""
    """"missing", or why it could not be read ("" when ``mode`` is set)."""
    folder_error: str = ""


STORES = ("audit_log", "jobs_db", "usage_db")
"""The router's files, by their ``router.*`` config field."""


def _stat(path: str) -> tuple[os.stat_result | None, str]:
    try:
        return os.stat(path), ""
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, exc.strerror or str(exc)


def file_state(path: str) -> FileState:
    """``path`` and its folder as ``os.stat`` finds them now."""
    folder = os.path.dirname(os.path.abspath(path))
    info, error = _stat(path)
    finfo, ferror = _stat(folder)
    return FileState(path, None if info is None else stat.S_IMODE(info.st_mode),
                     None if info is None else info.st_uid, folder,
                     None if finfo is None else stat.S_IMODE(finfo.st_mode), error, ferror)


def file_states(cfg: ClusterConfig) -> dict[str, FileState]:
    """The router's configured files (router.records.audit_log, jobs_db, usage_db), read
    on disk; a field that names no file (None) is absent."""
    return {name: file_state(path) for name in STORES if (path := getattr(cfg.router.records, name))}


@dataclass(slots=True)
class DeploymentState:
    """The live half of the statement's inputs (the config is the other)."""

    workers: list[LiveWorker] = field(default_factory=list)
    links: dict[str, LinkState] = field(default_factory=dict)
    """Link name ("a-b") -> its probed state; a link absent here has not been probed."""
    desired: dict[tuple[str, Role], int] = field(default_factory=dict)
    """(site, role) -> the pool's desired size now (`kvrelay scale` changes it); absent: the config's replicas."""
    version: str = "unknown"
    """kvrelay's version (the installed distribution's)."""
    model_path: str | None = None
    """The checkpoint the router serves, when it knows (else the config's model.path)."""
    generated_at: float = 0.0
    """Unix time of the snapshot."""
    files: dict[str, FileState] | None = None
    """The router's files as read on disk (``router.*`` field -> its state, :func:`file_states`);
    None: not read for this snapshot (a configured file absent from it likewise)."""


def kvrelay_version() -> str:
    """The installed kvrelay's version, else "unknown"."""
    try:
        return importlib.metadata.version("kvrelay")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def deployment_state(registry: WorkerRegistry, desired: dict[tuple[str, Role], int] | None = None,
                     model_path: str | None = None, now: float | None = None) -> DeploymentState:
    """A snapshot of ``registry`` (workers, link health) with the pools' desired sizes
    (router/cluster/pools.py ``PoolManager.desired``; None: the config's replicas), and
    the router's files (its config's) as read on disk now: call it in the router."""
    workers = [LiveWorker(r.info.worker_id, r.info.site, Role.of(r.info.role), r.info.device,
                          registry.healthy(r), r.draining, r.info.transport, r.info.model)
               for r in sorted(registry.workers.values(), key=lambda r: r.info.worker_id)]
    links = {lv.name: LinkState(lv.up, registry.link_health[key].reason) for key, lv in registry.links.items()}
    return DeploymentState(workers, links, dict(desired or {}),
                           kvrelay_version(), model_path, time.time() if now is None else now,
                           file_states(registry.cfg))


@dataclass(slots=True)
class Pool:
    """One site's prefill or decode pool, configured and live."""

    site: str
    jurisdiction: str
    role: Role
    desired: int
    min_replicas: int
    max_replicas: int
    device: str
    """Configured device (pool.device, else model.device)."""
    dedicated_to: list[str]
    """The tenants a dedicated pool serves; empty: shared by every tenant."""
    live: list[LiveWorker]

    @property
    def name(self) -> str:
        return f"{self.site}/{self.role}"

    @property
    def active(self) -> bool:
        """It has replicas or live workers: requests may land on it."""
        return self.desired > 0 or bool(self.live)

    def open_to(self, tenant: str) -> bool:
        return not self.dedicated_to or tenant in self.dedicated_to

    def facts(self) -> dict:
        """Plain data: configuration, live workers and devices, sharing."""
        return {"pool": self.name, "site": self.site, "jurisdiction": self.jurisdiction, "role": self.role,
                "device": self.device, "live_devices": sorted({w.device for w in self.live if w.device}),
                "desired": self.desired, "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "live": {"healthy": sum(w.healthy and not w.draining for w in self.live),
                         "unhealthy": sum(not w.healthy for w in self.live),
                         "draining": sum(w.draining for w in self.live)},
                "sharing": "dedicated" if self.dedicated_to else "shared", "dedicated_to": list(self.dedicated_to)}


@dataclass(slots=True)
class Reach:
    """Where one tenant's requests may run."""

    pools: list[Pool]
    """Pools its prompts and KV may reach, in config order."""
    links: list[dict]
    """Facts of each link its KV may cross (prefill pool -> decode pool): :func:`link_facts`."""
    closed: list[Pool]
    """Active pools in its jurisdictions dedicated to other tenants (never used for it)."""
    outside: list[Pool]
    """Active pools outside its jurisdictions."""

    @property
    def decodes(self) -> list[Pool]:
        return [p for p in self.pools if p.role == Role.DECODE]

    def sites(self) -> list[tuple[str, str]]:
        """(site, jurisdiction) of every pool it reaches, in config order."""
        return list(dict.fromkeys((p.site, p.jurisdiction) for p in self.pools))


def pools_of(cfg: ClusterConfig, state: DeploymentState) -> list[Pool]:
    """Every pool of the config, with its live workers and desired size."""
    out = []
    for s in cfg.sites:
        for role in Role:
            sec = s.pool(role)
            live = [w for w in state.workers if w.site == s.name and w.role == role]
            desired = state.desired.get((s.name, role), sec.replicas)
            out.append(Pool(s.name, s.jurisdiction, role, desired, sec.min_replicas, sec.max_replicas,
                            sec.device or cfg.model.device, list(sec.tenants), live))
    return out


def link_facts(topo: Topology, state: DeploymentState, link: LinkSection, name: str,
               senders: list[LiveWorker], tenant: str = "") -> dict:
    """A link as the statement reports it: the transport(s) its live senders
    use (else the configured one), protection, the KV codec ``tenant``'s KV crosses it with, probed state."""
    protection = str(topo.protection(link))
    live = sorted({str(topo.transport(link, w.transport)) for w in senders if w.transport})
    probed = state.links.get(name)
    where = ("within a site" if name == LOCAL_LINK else "not probed yet" if probed is None
             else "up" if probed.up else f"down ({probed.reason})")
    return {"link": name, "between": list(link.between), "rtt_ms": link.rtt_ms, "gbps": link.gbps,
            "transport": live or [str(topo.transport(link))], "protection": protection,
            "encrypted": protection == "aead", "kv_codec": str(topo.codec(link, tenant)),
            "auto_codecs": [str(c) for c in topo.auto_codecs()], "state": where}


def reach_of(topo: Topology, state: DeploymentState, pools: list[Pool], t: TenantSection) -> Reach:
    """Where tenant ``t``'s requests may run (placement's hard constraints over the config and the live pools)."""
    allowed = set(t.jurisdictions)
    active = [p for p in pools if p.active]
    inside = [p for p in active if not allowed or p.jurisdiction in allowed]
    usable = [p for p in inside if p.open_to(t.name)]
    decodes = [p for p in usable if p.role == Role.DECODE]
    crossed: dict[str, tuple[LinkSection, list[LiveWorker]]] = {}
    prefills = []
    for p in (p for p in usable if p.role == Role.PREFILL):
        for d in decodes:
            link = topo.link(p.site, d.site)
            if link is None:
                continue
            if p not in prefills:
                prefills.append(p)
            name = link_name(p.site, d.site)
            senders = crossed.setdefault(name, (link, []))[1]
            senders.extend(w for w in p.live if w not in senders)
    reached = [p for p in pools if p in decodes or p in prefills]
    links = [link_facts(topo, state, link, name, senders, t.name) for name, (link, senders) in crossed.items()]
    return Reach(reached, links, [p for p in inside if not p.open_to(t.name)], [p for p in active if p not in inside])


def tenants_of(cfg: ClusterConfig) -> list[TenantSection]:
    """The configured tenants, and ``anonymous`` (its entry's policy or the defaults) when allowed."""
    out = list(cfg.tenants)
    if cfg.auth.allow_anonymous and cfg.tenant(ANONYMOUS) is None:
        out.append(TenantPolicies(cfg).of(ANONYMOUS))
    return out


@dataclass(slots=True)
class Deployment:
    """What every answer of the statement reads: the config, the live state,
    the pools, and each tenant's reach."""

    cfg: ClusterConfig
    state: DeploymentState
    topo: Topology
    pools: list[Pool]
    tenants: list[TenantSection]
    reach: dict[str, Reach]

    @classmethod
    def of(cls, cfg: ClusterConfig, state: DeploymentState) -> Deployment:
        topo, pools, tenants = Topology(cfg), pools_of(cfg, state), tenants_of(cfg)
        return cls(cfg, state, topo, pools, tenants, {t.name: reach_of(topo, state, pools, t) for t in tenants})

    def users_of(self, pool: Pool) -> list[str]:
        """The tenants whose requests may run on ``pool``."""
        return [t.name for t in self.tenants if pool in self.reach[t.name].pools]

    def jurisdiction(self, site: str | None) -> str | None:
        """The jurisdiction of ``site`` (None: no site)."""
        return None if site is None else self.topo.jurisdiction.get(site)
