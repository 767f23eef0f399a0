"""The cluster config file: YAML parsed once into typed, validated
dataclasses. Any problem raises :class:`ConfigError` naming the field.

Example::

    model:
      path: null            # checkpoint folder; null = the embedded SmolLM2-135M-Instruct
      dtype: float32
    router:
      host: 127.0.0.1
      port: 50051           # 0 = any free port
      http_port: 8000       # OpenAI-compatible HTTP API; null = off
      policy: cost_model    # round_robin | least_loaded | prefix_aware | cost_model
    sites:
      - name: toronto
        jurisdiction: CA-ON
        prefill: {replicas: 1}
        decode: {replicas: 1}
      - name: montreal
        jurisdiction: CA-QC
        decode: {replicas: 1, device: cpu}
    links:                  # sites without a link never exchange KV
      - {between: [toronto, montreal], rtt_ms: 9, gbps: 10, transport: tcp, encrypt: true}
    cache: {block_size: 16, memory_gib: 1.0}
    scheduler: {max_num_batched_tokens: 2048, max_num_seqs: 64}
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from engine.config import CacheConfig, SchedulerConfig


class PlacementPolicy(StrEnum):
    """The router's placement policies (router/placement.py implements them)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AWARE = "prefix_aware"
    COST_MODEL = "cost_model"


class ConfigError(ValueError):
    """The config file is invalid; the message names the field."""


@dataclass(slots=True)
class ModelSection:
    path: str | None = None
    """Checkpoint folder; ``None`` = the embedded default model (prepared on first use)."""
    dtype: str = "float32"
    """float32 or bfloat16 on CPU; bfloat16 or float16 on CUDA."""
    device: str = "cpu"
    """cpu or cuda[:N]."""


@dataclass(slots=True)
class RouterSection:
    host: str = "127.0.0.1"
    """Address the router's gRPC server binds."""
    port: int = 50051
    """Port of the gRPC server; 0 picks a free one."""
    http_port: int | None = 8000
    """Port of the OpenAI-compatible HTTP API (same host); 0 picks a free one;
    null turns it off."""
    heartbeat_interval_s: float = 1.0
    """How often workers report load."""
    worker_timeout_s: float = 5.0
    """A worker silent this long is unhealthy and gets no requests."""
    link_probe_timeout_s: float = 1.0
    """Each heartbeat, every worker TCP-connects to a worker in each site linked
    to its own; a connect slower than this marks the link down (placement stops
    using it and transfers on it are re-placed) until a probe succeeds again."""
    kv_lease_s: float = 30.0
    """A decode worker frees a reservation whose KV has not arrived by then."""
    policy: str = "cost_model"
    """Placement policy: round_robin, least_loaded, prefix_aware or cost_model."""
    max_inflight_per_worker: int = 64
    """Admission bound: requests the router keeps on one worker at once; when
    every eligible worker is full, requests get RESOURCE_EXHAUSTED with a retry hint."""
    admission_wait_s: float = 60.0
    """A request that finds every eligible decode worker full waits at the router
    for room up to this long (never past its own deadline), then gets
    RESOURCE_EXHAUSTED with a retry hint."""
    unavailable_wait_s: float = 10.0
    """A request that finds no healthy decode worker it may use (workers
    restarting, or a router that just restarted and awaits their heartbeats)
    waits for one up to this long (never past its deadline), then gets UNAVAILABLE."""
    colocate_below_tokens: int = 32
    """Prompts shorter than this are prefilled by their decode worker."""
    default_prefill_tokens_per_s: float = 1000.0
    """Prefill throughput assumed for a worker until it has measured its own."""
    herd_tolerance: float = 0.05
    """cost_model picks at random among candidates within this fraction of the
    best estimate, so simultaneous requests do not all pile onto one worker."""
    slo_ttft_s: float = 2.0
    """Time-to-first-token objective the planner sizes prefill pools for."""
    slo_tpot_s: float = 0.2
    """Time-per-output-token objective the planner sizes decode pools for."""
    planner_window_s: float = 60.0
    """Recent requests the planner's figures cover."""
    jobs_db: str | None = None
    """SQLite file holding batch jobs and their results (durable across router
    restarts); None = `kvrelay serve` uses jobs.sqlite in the cache folder."""
    job_concurrency: int = 4
    """Job requests the router runs at once (only while no interactive request waits)."""
    drain_timeout_s: float = 600.0
    """A draining worker (scale-down, `kvrelay drain`) leaves after this even
    if requests remain; until then it finishes what it holds."""


@dataclass(slots=True)
class PoolSection:
    replicas: int = 1
    """Workers of this role at the site (at start; `kvrelay scale` changes it)."""
    max_replicas: int = 16
    """Operator limit: `kvrelay scale` refuses more than this."""
    min_replicas: int = 0
    """Operator limit for the planner (`kvrelay plan`): it never recommends fewer."""
    device: str | None = None
    """cpu or cuda[:N] for this pool; None = model.device."""


@dataclass(slots=True)
class LinkSection:
    """A network link between two sites (or, as ``local_link``, within a site)."""

    between: list[str] = field(default_factory=list)
    """The two site names (empty for local_link)."""
    rtt_ms: float = 0.2
    """Round-trip time."""
    gbps: float = 10.0
    """Bandwidth available to KV transfers, Gbit/s."""
    transport: str | None = None
    """KV transport on this link: tcp, nixl or local; None = kv.transport."""
    encrypt: bool | None = None
    """Encrypt KV payloads on this link; None = kv.encrypt."""


@dataclass(slots=True)
class SiteSection:
    name: str
    """Site name, e.g. toronto."""
    jurisdiction: str = "unspecified"
    """Where data at this site is processed, e.g. CA-ON."""
    prefill: PoolSection = field(default_factory=PoolSection)
    decode: PoolSection = field(default_factory=PoolSection)


@dataclass(slots=True)
class WorkerSection:
    host: str = "127.0.0.1"
    """Address workers bind and advertise (gRPC and KV receiver); "auto" = each
    worker's own address on the route to the router (multi-node, e.g. Ray)."""
    threads: int | None = None
    """torch threads per worker; None = torch's default."""


@dataclass(slots=True)
class KVSection:
    transport: str = "auto"
    """KV transport: auto (nixl where the host has RDMA, else tcp), tcp, nixl or local."""
    streams: int = 4
    """Parallel TCP connections per peer."""
    socket_buffer_bytes: int | None = None
    """TCP socket buffers; size to the link's bandwidth-delay product (None = kernel default)."""
    secret_file: str | None = None
    """File holding the deployment secret that authenticates KV connections;
    None = `kvrelay serve` makes a random one per run and hands it to its workers."""
    transfer_timeout_s: float = 30.0
    """A prefill worker gives up on (and frees the blocks of) a transfer not acknowledged by then."""
    encrypt: bool = False
    """Encrypt KV payloads on the wire (AES-256-GCM); receivers then refuse plaintext senders."""
    corrupt_first_transfers: int = 0
    """Fault injection (tests, chaos runs; never in service): each prefill worker
    flips one byte of the first N KV transfers it sends over TCP, after
    checksumming, so that receivers must detect and refuse them."""


@dataclass(slots=True)
class Credential:
    name: str
    """Who holds the token (shown in logs)."""
    token_sha256: str
    """Hex SHA-256 of the bearer token; the token itself is never stored.
    `kvrelay token` makes a token and prints this line for it."""


@dataclass(slots=True)
class AuthSection:
    operators: list[Credential] = field(default_factory=list)
    """Who may call the Admin API (kvrelay scale / drain / pools). Empty:
    `kvrelay serve` makes a token for this run and writes it to a file only
    its user can read."""
    clients: list[Credential] = field(default_factory=list)
    """Who may call the Inference and Jobs APIs (gRPC and HTTP), one entry per
    tenant (``name``); each tenant's prompts get their own prefix-cache domain.
    Empty: no client authentication (a trusted network)."""


@dataclass(slots=True)
class ClusterConfig:
    model: ModelSection = field(default_factory=ModelSection)
    router: RouterSection = field(default_factory=RouterSection)
    sites: list[SiteSection] = field(default_factory=lambda: [SiteSection(name="local")])
    links: list[LinkSection] = field(default_factory=list)
    """Links between sites; a pair of sites without one never exchanges KV."""
    local_link: LinkSection = field(default_factory=LinkSection)
    """The network between workers of one site."""
    workers: WorkerSection = field(default_factory=WorkerSection)
    kv: KVSection = field(default_factory=KVSection)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    auth: AuthSection = field(default_factory=AuthSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def _build(cls: type, raw: Any, where: str):
    """Builds dataclass ``cls`` from a mapping, naming ``where`` in errors."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; expected {', '.join(fields)}")
    kwargs = {}
    for name, value in raw.items():
        path = name if where == "config" else f"{where}.{name}"
        kwargs[name] = _convert(fields[name].type, value, path)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


_NESTED = {"ModelSection": ModelSection, "RouterSection": RouterSection, "PoolSection": PoolSection,
           "LinkSection": LinkSection, "AuthSection": AuthSection,
           "WorkerSection": WorkerSection, "KVSection": KVSection, "CacheConfig": CacheConfig, "SchedulerConfig": SchedulerConfig}


def _convert(type_str: Any, value: Any, path: str):
    t = str(type_str)
    if t in _NESTED:
        return _build(_NESTED[t], value, path)
    if t == "list[SiteSection]":
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{path}: expected a non-empty list of sites")
        return [_build(SiteSection, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if t == "list[LinkSection]":
        if value is None:
            return []
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list of links")
        return [_build(LinkSection, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if t == "list[Credential]":
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list of {{name, token_sha256}}")
        return [_build(Credential, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if t == "list[str]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: expected a list of strings")
        return list(value)
    if value is None:
        if "None" in t:
            return None
        raise ConfigError(f"{path}: must not be null")
    if t.startswith("int") and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if t.startswith("float") and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if t.startswith("bool") and not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if t.startswith("str") and not isinstance(value, str):
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return float(value) if t.startswith("float") else value


def _validate(cfg: ClusterConfig) -> None:
    if cfg.model.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"model.dtype: must be float32, bfloat16 or float16, got {cfg.model.dtype!r}")
    if not 0 <= cfg.router.port <= 65535:
        raise ConfigError(f"router.port: must be in [0, 65535], got {cfg.router.port}")
    for name in ("heartbeat_interval_s", "worker_timeout_s", "kv_lease_s", "drain_timeout_s", "slo_ttft_s",
                 "slo_tpot_s", "planner_window_s", "admission_wait_s", "link_probe_timeout_s",
                 "unavailable_wait_s"):
        if getattr(cfg.router, name) <= 0:
            raise ConfigError(f"router.{name}: must be positive")
    if cfg.router.link_probe_timeout_s > cfg.router.worker_timeout_s / 2:
        raise ConfigError(f"router.link_probe_timeout_s: must be at most half of worker_timeout_s "
                          f"({cfg.router.worker_timeout_s / 2:g}): a heartbeat waits for the probes")
    if cfg.kv.transport not in ("auto", "tcp", "nixl", "local"):
        raise ConfigError(f"kv.transport: must be auto, tcp, nixl or local, got {cfg.kv.transport!r}")
    if not 1 <= cfg.kv.streams <= 64:
        raise ConfigError(f"kv.streams: must be in [1, 64], got {cfg.kv.streams}")
    if cfg.kv.corrupt_first_transfers < 0:
        raise ConfigError("kv.corrupt_first_transfers: must be >= 0")
    if cfg.kv.transfer_timeout_s <= 0:
        raise ConfigError("kv.transfer_timeout_s: must be positive")
    seen = set()
    for i, site in enumerate(cfg.sites):
        if not _NAME.match(site.name):
            raise ConfigError(f"sites[{i}].name: {site.name!r} must be lowercase letters, digits, - or _")
        if site.name in seen:
            raise ConfigError(f"sites[{i}].name: duplicate site {site.name!r}")
        seen.add(site.name)
        for role in ("prefill", "decode"):
            pool = getattr(site, role)
            if not 0 <= pool.max_replicas <= 1024:
                raise ConfigError(f"sites[{i}].{role}.max_replicas: must be in [0, 1024], got {pool.max_replicas}")
            if not 0 <= pool.min_replicas <= pool.max_replicas:
                raise ConfigError(f"sites[{i}].{role}.min_replicas: must be in [0, max_replicas], "
                                  f"got {pool.min_replicas}")
            if not 0 <= pool.replicas <= pool.max_replicas:
                raise ConfigError(f"sites[{i}].{role}.replicas: must be in [0, max_replicas={pool.max_replicas}], "
                                  f"got {pool.replicas}")
            dev = getattr(site, role).device
            if dev is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", dev):
                raise ConfigError(f"sites[{i}].{role}.device: must be cpu or cuda[:N], got {dev!r}")
    if not any(s.decode.replicas for s in cfg.sites):
        raise ConfigError("sites: at least one site needs a decode worker (decode.replicas >= 1)")
    r = cfg.router
    if r.policy not in tuple(PlacementPolicy):
        raise ConfigError(f"router.policy: must be one of {', '.join(PlacementPolicy)}, got {r.policy!r}")
    if r.job_concurrency < 1:
        raise ConfigError("router.job_concurrency: must be >= 1")
    if r.max_inflight_per_worker < 1:
        raise ConfigError("router.max_inflight_per_worker: must be >= 1")
    if r.colocate_below_tokens < 0:
        raise ConfigError("router.colocate_below_tokens: must be >= 0")
    if r.default_prefill_tokens_per_s <= 0:
        raise ConfigError("router.default_prefill_tokens_per_s: must be positive")
    if not 0 <= r.herd_tolerance <= 1:
        raise ConfigError("router.herd_tolerance: must be in [0, 1]")
    if r.http_port is not None and not 0 <= r.http_port <= 65535:
        raise ConfigError(f"router.http_port: must be in [0, 65535] or null, got {r.http_port}")
    for kind in ("operators", "clients"):
        names = set()
        for i, cred in enumerate(getattr(cfg.auth, kind)):
            if not re.fullmatch(r"[0-9a-f]{64}", cred.token_sha256):
                raise ConfigError(f"auth.{kind}[{i}].token_sha256: must be 64 lowercase hex digits "
                                  "(the SHA-256 of the token; `kvrelay token` prints one)")
            if not cred.name or cred.name in names:
                raise ConfigError(f"auth.{kind}[{i}].name: must be non-empty and unique, got {cred.name!r}")
            names.add(cred.name)
    _check_link(cfg.local_link, "local_link")
    if cfg.local_link.between:
        raise ConfigError("local_link.between: must be empty (it is the network inside every site)")
    pairs = set()
    for i, link in enumerate(cfg.links):
        where = f"links[{i}]"
        _check_link(link, where)
        if len(link.between) != 2 or link.between[0] == link.between[1]:
            raise ConfigError(f"{where}.between: must name two different sites, got {link.between}")
        for name in link.between:
            if name not in seen:
                raise ConfigError(f"{where}.between: unknown site {name!r} (sites: {', '.join(sorted(seen))})")
        pair = frozenset(link.between)
        if pair in pairs:
            raise ConfigError(f"{where}: duplicate link between {link.between[0]} and {link.between[1]}")
        pairs.add(pair)


def _check_link(link: LinkSection, where: str) -> None:
    if not link.rtt_ms >= 0:
        raise ConfigError(f"{where}.rtt_ms: must be >= 0, got {link.rtt_ms}")
    if not link.gbps > 0:
        raise ConfigError(f"{where}.gbps: must be positive, got {link.gbps}")
    if link.transport not in (None, "tcp", "nixl", "local"):
        raise ConfigError(f"{where}.transport: must be tcp, nixl or local, got {link.transport!r}")


def parse_config(raw: Any) -> ClusterConfig:
    cfg = _build(ClusterConfig, raw, "config")
    _validate(cfg)
    return cfg


def load_config(path: str | Path | None) -> ClusterConfig:
    """The config in ``path``, or the embedded default when ``path`` is None."""
    if path is None:
        return parse_config({})
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def dump_config(cfg: ClusterConfig, path: Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
