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
      - {between: [toronto, montreal], rtt_ms: 9, gbps: 10, transport: tcp}
    cache: {block_size: 16, memory_gib: 1.0}
    scheduler: {max_num_batched_tokens: 2048, max_num_seqs: 64}

Every number must be finite (no ``.nan``, ``.inf``) and at most its field's
bound in :data:`FIELD_MAX`; the file itself at most :data:`MAX_CONFIG_BYTES`
of UTF-8 YAML.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import re
import reprlib
import string
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import yaml

from kvrelay.engine.config import CacheConfig, DType, SchedulerConfig
from kvrelay.kvtransfer.base import AUTO, Transport
from kvrelay.kvtransfer.protection import Protection
from kvrelay.runtime.roles import Role
from kvrelay.runtime.tenants import FieldError as TenantFieldError
from kvrelay.runtime.tenants import TenantSection, check_tenants


class ScalingOwner(StrEnum):
    """Who sets the number of workers in each pool (``router.scaling``)."""

    KVRELAY = "kvrelay"
    """The router: `kvrelay scale` and the planner change pool sizes, and
    kvrelay's launchers (local processes, Ray) start or drain workers to match."""
    EXTERNAL = "external"
    """An orchestrator (Kubernetes: the Helm chart's Deployments): the router
    takes every worker that registers, never drains one for the pool's size,
    and refuses `kvrelay scale` naming what to change instead."""


class PlacementPolicy(StrEnum):
    """The router's placement policies (router/placement/place.py implements them)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AWARE = "prefix_aware"
    COST_MODEL = "cost_model"


KVTransport = Transport | Literal["auto"]
"""``kv.transport``: one of the transports, or ``auto`` (:data:`kvtransfer.base.AUTO`)."""

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ConfigError(ValueError):
    """The config file is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class _HugeInt:
    """An integer in the YAML too long for Python to convert from text (its
    int-from-str digit limit); every numeric field refuses it, naming itself."""

    digits: int
    negative: bool

    def __repr__(self) -> str:
        return f"{'a negative' if self.negative else 'an'} integer of {self.digits} digits"


class _Repr(reprlib.Repr):
    """reprlib cut short: deep, long or recursive values and huge integers stay one short line."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 60, 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() <= 64:
            return repr(x)
        return f"{'a negative' if x < 0 else 'an'} integer of about {int(x.bit_length() * math.log10(2)) + 1} digits"


_REPR = _Repr()


def _show(value: Any) -> str:
    """``repr(value)`` for an error message, bounded whatever the value is."""
    return _REPR.repr(value)


class FieldError(ConfigError):
    """A section's own field is invalid. Raised by a section's ``__post_init__``
    with the field's name relative to the section; the builder prefixes the
    section's path (``router`` + ``port`` -> ``router.port: ...``)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def _one_of(values) -> str:
    """``a, b or c``."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


_E = TypeVar("_E", bound=StrEnum)


def _enum(cls: type[_E], value: Any, name: str, reason: str) -> _E:
    """``value`` as a member of ``cls``, else FieldError(name, reason + the value)."""
    try:
        return cls(value)
    except ValueError:
        raise FieldError(name, f"{reason}, got {value!r}") from None


def _positive(section: Any, *names: str) -> None:
    for name in names:
        if getattr(section, name) <= 0:
            raise FieldError(name, "must be positive")


@dataclass(slots=True)
class ModelSection:
    path: str | None = None
    """Checkpoint folder; ``None`` = the embedded default model (prepared on first use)."""
    dtype: DType = "float32"
    """float32 or bfloat16 on CPU; bfloat16 or float16 on CUDA."""
    device: str = "cpu"
    """cpu or cuda[:N]."""

    def __post_init__(self) -> None:
        if self.dtype not in get_args(DType):
            raise FieldError("dtype", f"must be {_one_of(get_args(DType))}, got {self.dtype!r}")


@dataclass(slots=True)
class HttpSection:
    """Bounds of the OpenAI-compatible HTTP API (``router.http``) against slow, large or greedy clients."""

    max_body_bytes: int = 8 << 20
    """A request body over this is refused (413) as it arrives, chunked or not."""
    header_timeout_s: float = 10.0
    """A connection must send a whole request head (and finish its TLS
    handshake) within this of connecting or of its previous response, or it is closed."""
    body_timeout_s: float = 30.0
    """A request body must arrive whole within this of its head (408 otherwise)."""
    max_connections: int = 1024
    """Open connections at most; one more gets 503 and is closed."""
    max_connections_per_client: int = 256
    """Open connections from one client address at most; one more gets 429 and is closed."""

    def __post_init__(self) -> None:
        _positive(self, "max_body_bytes", "header_timeout_s", "body_timeout_s", "max_connections",
                  "max_connections_per_client")


@dataclass(slots=True)
class ApiSection:
    """Bounds of the public API (``router.api``), shared by gRPC, HTTP and jobs."""

    max_prompt_bytes: int = 1 << 20
    """A prompt (or chat messages) over this many UTF-8 bytes is refused before tokenizing."""
    max_message_bytes: int = 16 << 20
    """Largest gRPC message the public listener takes (the internal one takes 64 MiB);
    a batch job's requests travel in one message (at most 15 MiB, router/frontends/jobs.py)."""
    max_concurrent_rpcs: int = 1024
    """gRPC calls the public listener serves at once; more get RESOURCE_EXHAUSTED."""
    tokenizer_threads: int = 2
    """Threads that tokenize prompts, off the router's event loop."""

    def __post_init__(self) -> None:
        _positive(self, "max_prompt_bytes", "max_message_bytes", "max_concurrent_rpcs", "tokenizer_threads")


@dataclass(slots=True)
class RouterSection:
    site: str | None = None
    """The site the router runs at (it tokenizes every prompt and keeps the
    jobs and audit files): the data-handling statement names its jurisdiction.
    None: not declared (the statement says so)."""
    host: str = "127.0.0.1"
    """Address the router's gRPC server binds."""
    port: int = 50051
    """Port of the gRPC server; 0 picks a free one."""
    http_port: int | None = 8000
    """Port of the OpenAI-compatible HTTP API (same host); 0 picks a free one;
    null turns it off."""
    internal_port: int = 50052
    """Mutual-TLS listener for workers (Registry) and certificate holders
    (operators, tenants with client certificates); 0 = any free port."""
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
    policy: PlacementPolicy = PlacementPolicy.COST_MODEL
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
    interactive_reserve: int = 1
    """Slots of every worker's max_inflight_per_worker that batch requests leave
    free, so an interactive request finds room at once however busy jobs keep it."""
    scaling: ScalingOwner = ScalingOwner.KVRELAY
    """Who sets pool sizes: kvrelay (its launchers follow `kvrelay scale`) or
    external (an orchestrator such as Kubernetes; `kvrelay scale` is refused)."""
    drain_timeout_s: float = 600.0
    """A draining worker (scale-down, `kvrelay drain`) leaves after this even
    if requests remain; until then it finishes what it holds."""
    http: HttpSection = field(default_factory=HttpSection)
    """Bounds of the HTTP API: body size, header and body deadlines, connections."""
    api: ApiSection = field(default_factory=ApiSection)
    """Bounds of the public API: prompt bytes, gRPC message size and concurrent calls, tokenizer threads."""
    audit_log: str | None = None
    """Append-only, hash-chained JSONL audit log (one record per request and
    per operator action); None = `kvrelay serve` uses audit.jsonl in the cache folder."""
    usage_db: str | None = None
    """SQLite file of usage accounting (the workers' own counters, per minute);
    None = `kvrelay serve` uses usage.sqlite in the cache folder."""
    retention_sweep_s: float = 3600.0
    """How often the retention sweeper deletes jobs and audit records past their tenant's retention."""
    operator_audit_retention_days: float = 365.0
    """Retention of audit records that belong to no tenant (operator actions, worker registrations)."""

    def __post_init__(self) -> None:
        for name in ("port", "internal_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise FieldError(name, f"must be in [0, 65535], got {getattr(self, name)}")
        _positive(self, "heartbeat_interval_s", "worker_timeout_s", "kv_lease_s", "drain_timeout_s", "slo_ttft_s",
                  "slo_tpot_s", "planner_window_s", "admission_wait_s", "link_probe_timeout_s",
                  "unavailable_wait_s", "retention_sweep_s", "operator_audit_retention_days")
        self.policy = _enum(PlacementPolicy, self.policy, "policy", f"must be one of {', '.join(PlacementPolicy)}")
        self.scaling = _enum(ScalingOwner, self.scaling, "scaling", f"must be {_one_of(ScalingOwner)}")
        self._check_limits()

    def _check_limits(self) -> None:
        if self.job_concurrency < 1:
            raise FieldError("job_concurrency", "must be >= 1")
        if self.max_inflight_per_worker < 1:
            raise FieldError("max_inflight_per_worker", "must be >= 1")
        if not 0 <= self.interactive_reserve < self.max_inflight_per_worker:
            raise FieldError("interactive_reserve", f"must be in [0, max_inflight_per_worker), got "
                                                    f"{self.interactive_reserve}")
        if self.colocate_below_tokens < 0:
            raise FieldError("colocate_below_tokens", "must be >= 0")
        _positive(self, "default_prefill_tokens_per_s")
        if not 0 <= self.herd_tolerance <= 1:
            raise FieldError("herd_tolerance", "must be in [0, 1]")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise FieldError("http_port", f"must be in [0, 65535] or null, got {self.http_port}")


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
    tenants: list[str] = field(default_factory=list)
    """Dedicated pool: only these tenants' requests are placed on it. Empty: shared by every tenant."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_replicas <= 1024:
            raise FieldError("max_replicas", f"must be in [0, 1024], got {self.max_replicas}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise FieldError("min_replicas", f"must be in [0, max_replicas], got {self.min_replicas}")
        if not 0 <= self.replicas <= self.max_replicas:
            raise FieldError("replicas", f"must be in [0, max_replicas={self.max_replicas}], got {self.replicas}")
        if self.device is not None and not _DEVICE.fullmatch(self.device):
            raise FieldError("device", f"must be cpu or cuda[:N], got {self.device!r}")


@dataclass(slots=True)
class LinkSection:
    """A network link between two sites (or, as ``local_link``, within a site)."""

    between: list[str] = field(default_factory=list)
    """The two site names (empty for local_link)."""
    rtt_ms: float = 0.2
    """Round-trip time."""
    gbps: float = 10.0
    """Bandwidth available to KV transfers, Gbit/s."""
    transport: Transport | None = None
    """KV transport on this link: tcp, nixl or local; None = kv.transport."""
    protection: Protection | None = None
    """KV protection on this link: aead (encrypted and authenticated) or
    integrity (authenticated, readable); None = kv.protection. Receivers
    enforce it for senders whose certificate names the other end's site."""

    def __post_init__(self) -> None:
        if not self.rtt_ms >= 0:
            raise FieldError("rtt_ms", f"must be >= 0, got {self.rtt_ms}")
        if not self.gbps > 0:
            raise FieldError("gbps", f"must be positive, got {self.gbps}")
        if self.transport is not None:
            self.transport = _enum(Transport, self.transport, "transport", f"must be {_one_of(Transport)}")
        if self.protection is not None:
            self.protection = _enum(Protection, self.protection, "protection", f"must be {_one_of(Protection)}")


@dataclass(slots=True)
class SiteSection:
    name: str
    """Site name, e.g. toronto."""
    jurisdiction: str = "unspecified"
    """Where data at this site is processed, e.g. CA-ON."""
    prefill: PoolSection = field(default_factory=PoolSection)
    decode: PoolSection = field(default_factory=PoolSection)

    def pool(self, role: Role) -> PoolSection:
        """The site's pool of ``role`` workers."""
        return self.prefill if role is Role.PREFILL else self.decode

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise FieldError("name", f"{self.name!r} must be lowercase letters, digits, - or _")


@dataclass(slots=True)
class WorkerSection:
    host: str = "127.0.0.1"
    """Address workers bind and advertise (gRPC and KV receiver); "auto" = each
    worker's own address on the route to the router (multi-node, e.g. Ray)."""
    threads: int | None = None
    """torch threads per worker; None = torch's default."""
    fail_engine_worker: str | None = None
    """Fault injection (tests and chaos only, never for service): the worker
    with this id has its engine step number ``fail_engine_at_step`` raise."""
    fail_engine_at_step: int = 1

    def __post_init__(self) -> None:
        if self.fail_engine_at_step < 1:
            raise FieldError("fail_engine_at_step", "must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise FieldError("threads", f"must be >= 1 or null, got {self.threads}")


@dataclass(slots=True)
class KVSection:
    transport: KVTransport = AUTO
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
    protection: Protection = Protection.AEAD
    """KV protection of links that name none: aead (AES-256-GCM, or
    ChaCha20-Poly1305 without AES instructions, over every frame) or integrity
    (a MAC over every frame, for links inside one machine room)."""
    corrupt_first_transfers: int = 0
    """Fault injection (tests, chaos runs; never in service): each prefill worker
    flips one sealed byte of the first N KV transfers it sends (as an on-path
    attacker would), so that receivers must detect and refuse them."""

    def __post_init__(self) -> None:
        if self.transport != AUTO:
            self.transport = _enum(Transport, self.transport, "transport", f"must be {_one_of([AUTO, *Transport])}")
        if not 1 <= self.streams <= 64:
            raise FieldError("streams", f"must be in [1, 64], got {self.streams}")
        self.protection = _enum(Protection, self.protection, "protection", f"must be {_one_of(Protection)}")
        if self.corrupt_first_transfers < 0:
            raise FieldError("corrupt_first_transfers", "must be >= 0")
        if self.socket_buffer_bytes is not None and self.socket_buffer_bytes < 0:
            raise FieldError("socket_buffer_bytes", f"must be >= 0 or null, got {self.socket_buffer_bytes}")
        _positive(self, "transfer_timeout_s")


@dataclass(slots=True)
class Credential:
    name: str
    """Who holds the token (shown in logs)."""
    token_sha256: str
    """Hex SHA-256 of the bearer token; the token itself is never stored.
    `kvrelay token` makes a token and prints this line for it."""

    def __post_init__(self) -> None:
        if not _SHA256.fullmatch(self.token_sha256):
            raise FieldError("token_sha256", "must be 64 lowercase hex digits "
                                             "(the SHA-256 of the token; `kvrelay token` prints one)")


@dataclass(slots=True)
class AuthSection:
    operators: list[Credential] = field(default_factory=list)
    """Who may call the Admin API (kvrelay scale / drain / pools). Empty:
    `kvrelay serve` makes a token for this run and writes it to a file only
    its user can read."""
    allow_anonymous: bool = False
    """Serve clients that present no credentials (all of them one tenant,
    "anonymous", with the policy of a ``tenants`` entry of that name if there
    is one). Refused unless every listener is on a loopback address."""

    def __post_init__(self) -> None:
        names = set()
        for i, cred in enumerate(self.operators):
            if not cred.name or cred.name in names:
                raise FieldError(f"operators[{i}].name", f"must be non-empty and unique, got {cred.name!r}")
            names.add(cred.name)


@dataclass(slots=True)
class TLSSection:
    """Certificates of the cluster PKI (``kvrelay pki``). Every gRPC and HTTP
    listener speaks TLS; internal ones (Registry, workers) mutual TLS."""

    enabled: bool = True
    """False: plaintext everywhere (comparisons on one machine); refused
    unless every listener is on a loopback address."""
    ca: str | None = None
    """CA bundle (PEM) every process trusts. None: `kvrelay serve` uses the
    per-user CA it makes under the cache folder."""
    ca_key: str | None = None
    """The CA's key: the launcher then issues a certificate to each process it
    starts. Without it, each process uses ``cert``/``key``."""
    cert: str | None = None
    """This process's certificate (PEM), when the launcher does not issue one."""
    key: str | None = None
    """Its private key (PEM, unencrypted, readable by this user only)."""
    cert_days: float = 30.0
    """Lifetime of the certificates the launcher and `kvrelay pki issue` make."""
    revoked_serials: list[str] = field(default_factory=list)
    """Serials (hex, as `kvrelay pki show` prints them) refused although the CA signed them."""
    server_names: list[str] = field(default_factory=list)
    """More DNS names or IP addresses for the router's server certificate
    (its host, localhost and 127.0.0.1 are always in it)."""

    def __post_init__(self) -> None:
        _positive(self, "cert_days")
        for i, serial in enumerate(self.revoked_serials):
            if not re.fullmatch(r"[0-9a-fA-F:]{1,64}", serial):
                raise FieldError(f"revoked_serials[{i}]", f"must be a hex serial, got {serial!r}")
        if (self.cert is None) != (self.key is None):
            raise FieldError("key" if self.key is None else "cert", "cert and key go together")


class TraceExport(StrEnum):
    """Where a process's spans go (``telemetry.traces``)."""

    NONE = "none"
    """Not traced (a client's ``traceparent`` still reaches the workers)."""
    OTLP = "otlp"
    """OTLP over gRPC to a collector at ``telemetry.endpoint``."""
    FILE = "file"
    """One JSONL file per process (``telemetry.file``), which ``kvrelay trace`` reads."""


@dataclass(slots=True)
class TelemetrySection:
    """Traces (OpenTelemetry) and metrics (Prometheus) of every process."""

    traces: TraceExport = TraceExport.NONE
    """none | otlp | file."""
    endpoint: str | None = None
    """OTLP collector, ``https://host:4317`` (TLS) or ``http://`` to a loopback
    address only (spans name tenants, sites and workers)."""
    ca_file: str | None = None
    """CA bundle that signs an ``https://`` collector's certificate (None: the system's roots)."""
    file: str = "kvrelay-traces/{process}.jsonl"
    """The JSONL file of each process; ``{process}`` becomes ``router`` or the
    worker (``toronto-decode-0``). Relative paths are from the process's directory."""
    file_max_bytes: int = 256 << 20
    """A process's trace file is moved to ``<name>.1.jsonl`` (replacing the one
    before) when it reaches this size, so spans never fill the disk."""
    sample_ratio: float = 1.0
    """Share of requests traced, in [0, 1]; a client's sampled ``traceparent`` is always followed."""
    metrics_host: str = "127.0.0.1"
    """Where every process serves /metrics. A non-loopback address needs
    ``metrics_exposed: true``: the exposition is plaintext HTTP without credentials."""
    metrics_exposed: bool = False
    """Allow a non-loopback ``metrics_host`` (behind a network policy that admits only the scraper)."""
    router_metrics_port: int | None = 0
    """The router's /metrics port; 0 = any free port, null = no metrics."""
    worker_metrics_port: int | None = 0
    """Each worker's /metrics port (0 = any free port, advertised when it registers; null = none).
    A fixed port suits one worker per host or pod (Kubernetes), not several."""
    prometheus_targets: str | None = None
    """A Prometheus ``file_sd`` JSON file the router keeps up to date with every
    process's /metrics address (labels: role, site, worker); None = not written."""

    def __post_init__(self) -> None:
        self.traces = _enum(TraceExport, self.traces, "traces", f"must be {_one_of(TraceExport)}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise FieldError("sample_ratio", f"must be in [0, 1], got {self.sample_ratio}")
        if self.traces is TraceExport.OTLP:
            _check_collector(self.endpoint)
        elif self.endpoint is not None or self.ca_file is not None:
            raise FieldError("endpoint" if self.endpoint is not None else "ca_file",
                             f"is only used with traces: otlp (traces is {self.traces.value})")
        if self.ca_file is not None and (self.endpoint or "").startswith("http://"):
            raise FieldError("ca_file", "is only used with an https:// endpoint")
        _check_file_template(self.file)
        for name in ("router_metrics_port", "worker_metrics_port"):
            port = getattr(self, name)
            if port is not None and port < 0:
                raise FieldError(name, f"must be a port in [0, 65535] or null, got {port}")
        if self.file_max_bytes < 1 << 20:
            raise FieldError("file_max_bytes", f"must be at least 1 MiB, got {self.file_max_bytes}")
        if not is_loopback(self.metrics_host) and not self.metrics_exposed:
            raise FieldError("metrics_host", f"{self.metrics_host} is not a loopback address; /metrics is "
                             "plaintext without credentials: set metrics_exposed: true behind a network policy")


def _check_file_template(template: str) -> None:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise FieldError("file", f"{template!r} is not a valid template ({exc})") from None
    if fields != {"process"}:
        raise FieldError("file", f"must contain {{process}} (each process writes its own file) and no other "
                         f"{{field}}, got {template!r}")


def _check_collector(endpoint: str | None) -> None:
    m = re.fullmatch(r"(https?)://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})/?", endpoint or "")
    if m is None:
        raise FieldError("endpoint", f"traces: otlp needs endpoint: https://host:port (or http:// to loopback), "
                         f"got {endpoint!r}")
    if not 0 < int(m.group(3)) <= 65_535:
        raise FieldError("endpoint", f"port {m.group(3)} of {endpoint} is not in [1, 65535]")
    if m.group(1) == "http" and not is_loopback(m.group(2).strip("[]")):
        raise FieldError("endpoint", f"{endpoint} would send spans in plaintext off this host: use https://")


@dataclass(slots=True)
class HealthSection:
    """``/livez`` and ``/readyz`` of every process (runtime/health.py), for an
    orchestrator's probes. Off by default; the Helm chart turns it on."""

    host: str = "127.0.0.1"
    """Where the probe listeners bind (0.0.0.0 in a pod: the kubelet probes the pod's address).
    The answers carry no data beyond ok or a one-line reason, so any address is allowed."""
    router_port: int | None = None
    """The router's probe port; 0 = any free port, null = none."""
    worker_port: int | None = None
    """Each worker's probe port (a fixed one suits one worker per pod); null = none."""

    def __post_init__(self) -> None:
        for name in ("router_port", "worker_port"):
            port = getattr(self, name)
            if port is not None and port < 0:
                raise FieldError(name, f"must be a port in [0, 65535] or null, got {port}")


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
    tls: TLSSection = field(default_factory=TLSSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    health: HealthSection = field(default_factory=HealthSection)
    """Probe endpoints of every process (off unless a port is set)."""
    tenants: list[TenantSection] = field(default_factory=list)
    """Who may call the Inference and Jobs APIs (gRPC and HTTP), one entry per
    tenant with its credential and policy (runtime/tenants.py). Empty: nobody
    may, unless ``auth.allow_anonymous`` (`kvrelay serve` adds tenant ``local``)."""

    def tenant(self, name: str) -> TenantSection | None:
        """The policy of tenant ``name`` (None: not configured)."""
        return next((t for t in self.tenants if t.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (enums as their string values), as YAML and JSON take it."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, enum.Enum) else value


def _path(where: str, name: str) -> str:
    """The config path of field ``name`` of the section at ``where``."""
    return name if where == "config" else f"{where}.{name}"


def _build(cls: type, raw: Any, where: str):
    """Builds dataclass ``cls`` from a mapping, naming ``where`` in errors
    (a section's own FieldError gets ``where`` prefixed to its field)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _check_known(raw, fields, where)
    kwargs = {name: _convert(fields[name].type, value, _path(where, name), FIELD_MAX.get((cls.__name__, name)))
              for name, value in raw.items()}
    try:
        return cls(**kwargs)
    except (FieldError, TenantFieldError) as exc:
        raise ConfigError(f"{_path(where, exc.name)}: {exc.reason}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_known(raw: dict, fields: dict, where: str) -> None:
    """Every key of ``raw`` is a field (keys may be any YAML scalar, not only strings)."""
    unknown = sorted(k if isinstance(k, str) else _show(k) for k in raw if k not in fields)
    if unknown:
        hints = "".join(f" ({name}: {_RENAMED[name]})" for name in unknown if name in _RENAMED)
        names = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise ConfigError(f"{where}: unknown field(s) {names}{hints}; expected {', '.join(fields)}")


_NESTED = {"ModelSection": ModelSection, "RouterSection": RouterSection, "HttpSection": HttpSection,
           "ApiSection": ApiSection, "PoolSection": PoolSection,
           "LinkSection": LinkSection, "AuthSection": AuthSection, "WorkerSection": WorkerSection,
           "KVSection": KVSection, "TLSSection": TLSSection, "TelemetrySection": TelemetrySection,
           "HealthSection": HealthSection, "CacheConfig": CacheConfig,
           "SchedulerConfig": SchedulerConfig}

_LISTS = {"list[SiteSection]": (SiteSection, False), "list[LinkSection]": (LinkSection, True),
          "list[Credential]": (Credential, True), "list[TenantSection]": (TenantSection, True)}
"""List fields of sections: the entry class, and whether the list may be empty."""
_ENTRY_NAMES = {"SiteSection": "sites", "LinkSection": "links", "Credential": "credentials",
                "TenantSection": "tenants"}

_RENAMED = {"encrypt": "replaced by protection: aead | integrity; every link is encrypted unless it says integrity",
            "clients": "moved to the top-level tenants: [{name, token_sha256, ...policy}]"}
"""Fields that no longer exist, and what replaced them."""

_STRING_LIKE = {"ScalingOwner", "TraceExport", "TenantPriority", "DType", "PlacementPolicy", "KVTransport",
                "Transport | None", "Protection", "Protection | None"}
"""Annotations of fields that YAML spells as strings (the sections check the value)."""

_DAY_S = 86_400
_TOKENS = 10_000_000
"""Bound of token counts: well past any model's context window."""

FIELD_MAX: dict[tuple[str, str], int] = {
    # router: ports, durations (seconds), counts, rates
    ("RouterSection", "port"): 65_535,
    ("RouterSection", "http_port"): 65_535,
    ("RouterSection", "internal_port"): 65_535,
    ("RouterSection", "heartbeat_interval_s"): 3_600,
    ("RouterSection", "worker_timeout_s"): _DAY_S,
    ("RouterSection", "link_probe_timeout_s"): 3_600,
    ("RouterSection", "kv_lease_s"): _DAY_S,
    ("RouterSection", "max_inflight_per_worker"): 65_536,
    ("RouterSection", "admission_wait_s"): _DAY_S,
    ("RouterSection", "unavailable_wait_s"): _DAY_S,
    ("RouterSection", "colocate_below_tokens"): _TOKENS,
    ("RouterSection", "default_prefill_tokens_per_s"): 1_000_000_000,
    ("RouterSection", "herd_tolerance"): 1,
    ("RouterSection", "slo_ttft_s"): 3_600,
    ("RouterSection", "slo_tpot_s"): 3_600,
    ("RouterSection", "planner_window_s"): _DAY_S,
    ("RouterSection", "job_concurrency"): 4_096,
    ("RouterSection", "interactive_reserve"): 65_535,
    ("RouterSection", "drain_timeout_s"): _DAY_S,
    ("RouterSection", "retention_sweep_s"): _DAY_S,
    ("RouterSection", "operator_audit_retention_days"): 36_500,
    # router.http and router.api
    ("HttpSection", "max_body_bytes"): 1 << 30,
    ("HttpSection", "header_timeout_s"): 3_600,
    ("HttpSection", "body_timeout_s"): _DAY_S,
    ("HttpSection", "max_connections"): 1_000_000,
    ("HttpSection", "max_connections_per_client"): 1_000_000,
    ("ApiSection", "max_prompt_bytes"): 1 << 30,
    ("ApiSection", "max_message_bytes"): 1 << 30,
    ("ApiSection", "max_concurrent_rpcs"): 1_000_000,
    ("ApiSection", "tokenizer_threads"): 256,
    # sites[i].prefill / .decode
    ("PoolSection", "replicas"): 1_024,
    ("PoolSection", "max_replicas"): 1_024,
    ("PoolSection", "min_replicas"): 1_024,
    # links[i] and local_link: one minute of RTT, 10 Tbit/s
    ("LinkSection", "rtt_ms"): 60_000,
    ("LinkSection", "gbps"): 10_000,
    # workers
    ("WorkerSection", "threads"): 1_024,
    ("WorkerSection", "fail_engine_at_step"): 1_000_000_000,
    # kv
    ("KVSection", "streams"): 64,
    ("KVSection", "socket_buffer_bytes"): 1 << 30,
    ("KVSection", "transfer_timeout_s"): _DAY_S,
    ("KVSection", "corrupt_first_transfers"): 1_000_000_000,
    # tenants[i]: a hundred years of retention, a billion per minute
    ("TenantSection", "weight"): 1_000_000,
    ("TenantSection", "requests_per_minute"): 1_000_000_000,
    ("TenantSection", "tokens_per_minute"): 1_000_000_000_000,
    ("TenantSection", "max_concurrent"): 1_000_000,
    ("TenantSection", "max_context"): _TOKENS,
    ("TenantSection", "job_retention_days"): 36_500,
    ("TenantSection", "audit_retention_days"): 36_500,
    # telemetry
    ("TelemetrySection", "router_metrics_port"): 65_535,
    ("TelemetrySection", "worker_metrics_port"): 65_535,
    ("TelemetrySection", "sample_ratio"): 1,
    ("TelemetrySection", "file_max_bytes"): 1 << 40,
    # health
    ("HealthSection", "router_port"): 65_535,
    ("HealthSection", "worker_port"): 65_535,
    # tls: ten years
    ("TLSSection", "cert_days"): 3_650,
    # cache (engine.config.CacheConfig): 4 TiB of KV
    ("CacheConfig", "block_size"): 4_096,
    ("CacheConfig", "num_blocks"): 1 << 24,
    ("CacheConfig", "memory_gib"): 4_096,
    # scheduler (engine.config.SchedulerConfig)
    ("SchedulerConfig", "max_num_batched_tokens"): _TOKENS,
    ("SchedulerConfig", "max_num_seqs"): 65_536,
    ("SchedulerConfig", "max_model_len"): _TOKENS,
}
"""The upper bound of every numeric field, by (section class, field): generous
sanity limits, so that a typo or a hostile file fails here rather than as a
huge allocation or a timer that never fires. The sections check lower bounds."""


def _convert(type_str: Any, value: Any, path: str, limit: int | None = None):
    """``value`` as the field annotated ``type_str`` at ``path`` (``limit``: its FIELD_MAX)."""
    t = str(type_str)
    if t in _NESTED:
        return _build(_NESTED[t], value, path)
    if t in _LISTS:
        cls, may_be_empty = _LISTS[t]
        if value is None and may_be_empty:
            return []
        if not isinstance(value, list) or not (value or may_be_empty):
            kind = "a list" if may_be_empty else "a non-empty list"
            raise ConfigError(f"{path}: expected {kind} of {_ENTRY_NAMES.get(cls.__name__, 'entries')} "
                              f"{{{', '.join(f.name for f in dataclasses.fields(cls))}}}")
        return [_build(cls, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if t == "list[str]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: expected a list of strings")
        return list(value)
    return _convert_scalar(t, value, path, limit)


def _convert_scalar(t: str, value: Any, path: str, limit: int | None):
    if value is None:
        if "None" in t:
            return None
        raise ConfigError(f"{path}: must not be null")
    numeric = t.startswith(("int", "float"))
    if numeric and isinstance(value, _HugeInt):
        raise ConfigError(f"{path}: must be {'>= 0' if value.negative else f'<= {limit}'}, got {value!r}")
    _check_type(t, value, path)
    return _check_number(t, value, path, limit) if numeric else value


def _check_type(t: str, value: Any, path: str) -> None:
    """``value`` is what YAML gives for annotation ``t`` (booleans are not numbers)."""
    if t.startswith("int") and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path}: expected an integer, got {_show(value)}")
    if t.startswith("float") and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{path}: expected a number, got {_show(value)}")
    if t.startswith("bool") and not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {_show(value)}")
    if (t.startswith("str") or t in _STRING_LIKE) and not isinstance(value, str):
        raise ConfigError(f"{path}: expected a string, got {_show(value)}")


def _check_number(t: str, value: int | float, path: str, limit: int | None) -> int | float:
    """The one place numbers are checked: finite, at most ``limit``, and not so
    negative that the section's own lower-bound check could not print it. Every
    field's lower bound is >= 0, which the section checks with its own message."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value}")
    if limit is not None and value > limit:
        raise ConfigError(f"{path}: must be <= {limit}, got {_show(value)}")
    if limit is not None and value < -limit:
        raise ConfigError(f"{path}: must be >= 0, got {_show(value)}")
    return float(value) if t.startswith("float") else value


def _validate(cfg: ClusterConfig) -> None:
    """The rules that span sections (each section checked its own fields when built)."""
    _check_probe_timeout(cfg.router)
    sites = _check_sites(cfg.sites)
    if cfg.local_link.between:
        raise ConfigError("local_link.between: must be empty (it is the network inside every site)")
    _check_links(cfg.links, sites)
    _check_tenants(cfg)
    if cfg.router.site is not None and cfg.router.site not in sites:
        raise ConfigError(f"router.site: unknown site {cfg.router.site!r} (sites: {', '.join(sorted(sites))})")
    _check_loopback(cfg)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``;
    a name such as ``127.example.net`` is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_loopback(cfg: ClusterConfig) -> None:
    """Plaintext and anonymous access are for one machine only."""
    exposed = [f"{n} {h}" for n, h in (("router.host", cfg.router.host), ("workers.host", cfg.workers.host))
               if not is_loopback(h)]
    if exposed and not cfg.tls.enabled:
        raise ConfigError(f"tls.enabled: false is refused because {exposed[0]} is not a loopback address")
    if exposed and cfg.auth.allow_anonymous:
        raise ConfigError(f"auth.allow_anonymous: true is refused because {exposed[0]} is not a loopback address")


def _check_probe_timeout(r: RouterSection) -> None:
    if r.link_probe_timeout_s > r.worker_timeout_s / 2:
        raise ConfigError(f"router.link_probe_timeout_s: must be at most half of worker_timeout_s "
                          f"({r.worker_timeout_s / 2:g}): a heartbeat waits for the probes")


def _check_sites(sites: list[SiteSection]) -> set[str]:
    """Site names are unique and some site decodes; returns the names."""
    seen = set()
    for i, site in enumerate(sites):
        if site.name in seen:
            raise ConfigError(f"sites[{i}].name: duplicate site {site.name!r}")
        seen.add(site.name)
    if not any(s.decode.replicas for s in sites):
        raise ConfigError("sites: at least one site needs a decode worker (decode.replicas >= 1)")
    return seen


def _check_links(links: list[LinkSection], sites: set[str]) -> None:
    """Each link joins two known, different sites, and no pair has two links."""
    pairs = set()
    for i, link in enumerate(links):
        where = f"links[{i}]"
        if len(link.between) != 2 or link.between[0] == link.between[1]:
            raise ConfigError(f"{where}.between: must name two different sites, got {link.between}")
        for name in link.between:
            if name not in sites:
                raise ConfigError(f"{where}.between: unknown site {name!r} (sites: {', '.join(sorted(sites))})")
        pair = frozenset(link.between)
        if pair in pairs:
            raise ConfigError(f"{where}: duplicate link between {link.between[0]} and {link.between[1]}")
        pairs.add(pair)


def _check_tenants(cfg: ClusterConfig) -> None:
    """Tenant entries agree with each other and the sites; dedicated pools name known tenants."""
    try:
        check_tenants(cfg.tenants, {s.jurisdiction for s in cfg.sites})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    names = {t.name for t in cfg.tenants} | ({"anonymous"} if cfg.auth.allow_anonymous else set())
    for i, site in enumerate(cfg.sites):
        for role in Role:
            dedicated = site.pool(role).tenants
            for name in dedicated:
                if name not in names:
                    raise ConfigError(f"sites[{i}].{role}.tenants: {name!r} is not a tenant "
                                      f"(tenants: {', '.join(sorted(names)) or 'none'})")
            if dedicated and all((t := cfg.tenant(n)) is not None and t.jurisdictions and
                                 site.jurisdiction not in t.jurisdictions for n in dedicated):
                raise ConfigError(f"sites[{i}].{role}.tenants: the pool is in {site.jurisdiction}, where none of "
                                  f"{', '.join(dedicated)} may be served (their jurisdictions); it would serve nobody")


def parse_config(raw: Any) -> ClusterConfig:
    cfg = _build(ClusterConfig, raw, "config")
    _validate(cfg)
    return cfg


MAX_CONFIG_BYTES = 1 << 20
"""A config file larger than this (1 MiB) is refused unread."""


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader, except that an integer too long for Python to convert
    from text becomes a :class:`_HugeInt` (refused naming its field) instead of a ValueError."""


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int | _HugeInt:
    """YAML's int, or a _HugeInt when it has more digits than Python converts."""
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:
        digits = sum(c.isdigit() for c in str(node.value))
        if digits <= sys.get_int_max_str_digits():
            raise
        return _HugeInt(digits, str(node.value).lstrip().startswith("-"))


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _read_text(path: Path) -> str:
    """The file's text: at most MAX_CONFIG_BYTES, UTF-8."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: config file is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (invalid byte at offset {exc.start})") from None


def _read_yaml(path: Path) -> Any:
    """The YAML document in ``path``, parsed safely; any parser failure is a ConfigError."""
    text = _read_text(path)
    try:
        return yaml.load(text, Loader=_Loader)
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML (nested too deeply)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({_show_error(exc)})") from None
    except (ValueError, TypeError, ArithmeticError, LookupError, AttributeError) as exc:
        # PyYAML's constructors fail on impossible dates (2020-13-45) and tagged
        # nonsense (``!!float ""``, ``!!bool x``, ``!!timestamp x``) with these.
        raise ConfigError(f"{path}: not valid YAML (a value that does not fit its type or tag: "
                          f"{type(exc).__name__}: {_show_error(exc)})") from None


def _show_error(exc: Exception) -> str:
    """The parser's message, cut to 500 characters."""
    text = str(exc)
    return text if len(text) <= 500 else f"{text[:500]}..."


def load_config(path: str | Path | None) -> ClusterConfig:
    """The config in ``path``, or the embedded default when ``path`` is None."""
    if path is None:
        return parse_config({})
    path = Path(path)
    raw = _read_yaml(path)
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def dump_config(cfg: ClusterConfig, path: Path) -> None:
    """Writes ``cfg`` as plain YAML (enums as their strings) that load_config reads back."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
