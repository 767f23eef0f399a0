"""The cluster config file: YAML parsed once into typed, validated
dataclasses. Any problem raises :class:`ConfigError` naming the field's path
(``sites[0].decode.replicas: must be <= 1024, got 5000``).

Example::

    model:
      path: null            # checkpoint folder; null = the embedded SmolLM2-135M-Instruct
      dtype: float32
    router:
      host: 127.0.0.1
      port: 50051           # 0 = any free port
      http_port: 8000       # OpenAI-compatible HTTP API; null = off
      placement: {policy: cost_model}   # round_robin | least_loaded | prefix_aware | cost_model
      admission: {max_inflight_per_worker: 64, interactive_reserve: 1}
      liveness: {heartbeat_interval_s: 1.0, worker_timeout_s: 5.0}
      pools: {scaling: kvrelay, slo_ttft_s: 2.0}
      records: {audit_log: null, jobs_db: null}   # null = `kvrelay serve` picks files in its cache folder
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

The sections are pydantic dataclasses (slotted, mutable, ``dataclasses.fields``
and ``asdict`` work on them). pydantic rather than a hand-made type system or
msgspec: each bound is declared on its field (``Field(ge=, le=)``), its
validation errors carry a structured location that :func:`parse_config` turns
into our field paths and wording, the Helm chart's values schema is generated
from the same declarations (launch/helm.py), and it is the most widely
maintained of the options. Every number must be finite (no ``.nan``,
``.inf``) and within its field's bounds (:func:`bounds`); the file itself at
most :data:`MAX_CONFIG_BYTES` of UTF-8 YAML. Rules across fields stay in each
section's ``__post_init__``, rules across sections in :func:`_validate`.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import string
import sys
import urllib.parse
from dataclasses import field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import annotated_types
import yaml
from pydantic import BeforeValidator, Field, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass, is_pydantic_dataclass
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from kvrelay.engine.config import (
    MAX_TOKENS,
    SECTION_CONFIG,
    CacheConfig,
    ConfigSection,
    DType,
    FieldError,
    SchedulerConfig,
    StringList,
    choice,
    show,
)
from kvrelay.kvtransfer.base import AUTO, KVCodec, Transport
from kvrelay.kvtransfer.protection import Protection
from kvrelay.runtime.addresses import is_loopback
from kvrelay.runtime.engines import EngineField, EngineKind, VllmSection
from kvrelay.runtime.roles import Role
from kvrelay.runtime.tenants import TenantSection, check_tenants


class ScalingOwner(StrEnum):
    """Who sets the number of workers in each pool (``router.pools.scaling``)."""

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

_DAY_S = 86_400
_PORT_BOUNDS = (0, 65_535)
"""The bounds of a port (0: any free one), which error messages call a port."""
_MAX_REPLICAS = 1_024


def _one_of(values) -> str:
    """``a, b or c``."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


# Fields YAML spells as strings, each refusing anything else with its own wording
Policy = Annotated[PlacementPolicy, choice(PlacementPolicy, f"one of {', '.join(PlacementPolicy)}")]
Scaling = Annotated[ScalingOwner, choice(ScalingOwner, _one_of(ScalingOwner))]
LinkTransport = Annotated[Transport, choice(Transport, _one_of(Transport))]
KVTransportField = Annotated[KVTransport, choice([AUTO, *Transport], _one_of([AUTO, *Transport]))]
ProtectionField = Annotated[Protection, choice(Protection, _one_of(Protection))]
DTypeField = Annotated[DType, choice(get_args(DType), _one_of(get_args(DType)))]
LinkCodec = KVCodec | Literal["auto"]
"""``links[].kv_codec``: one of the codecs, or ``auto`` (placement's choice per request among ``kv.auto_codecs``)."""
CodecField = Annotated[LinkCodec, choice([*KVCodec, AUTO], _one_of([*KVCodec, AUTO]))]


class ConfigError(ValueError):
    """The config file is invalid; the message names the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class _HugeInt:
    """An integer in the YAML too long for Python to convert from text (its
    int-from-str digit limit); every numeric field refuses it, naming itself."""

    digits: int
    negative: bool

    def __repr__(self) -> str:
        return f"{'a negative' if self.negative else 'an'} integer of {self.digits} digits"


def _entries(cls: type, what: str, may_be_empty: bool = True) -> BeforeValidator:
    """The check of a list field of ``cls`` entries: a list (null: empty, where it may be)."""

    def check(value: Any) -> Any:
        if value is None and may_be_empty:
            return []
        if not isinstance(value, list) or not (value or may_be_empty):
            kind = "a list" if may_be_empty else "a non-empty list"
            raise ValueError(f"expected {kind} of {what} {{{', '.join(f.name for f in dataclasses.fields(cls))}}}")
        return value

    return BeforeValidator(check)


@dataclass(slots=True, config=SECTION_CONFIG)
class ModelSection(ConfigSection):
    path: StrictStr | None = None
    """Checkpoint folder; ``None`` = the embedded default model (prepared on first use)."""
    dtype: DTypeField = "float32"
    """float32 or bfloat16 on CPU; bfloat16 or float16 on CUDA."""
    device: StrictStr = "cpu"
    """cpu or cuda[:N]."""


@dataclass(slots=True, config=SECTION_CONFIG)
class HttpSection(ConfigSection):
    """Bounds of the OpenAI-compatible HTTP API (``router.http``) against slow, large or greedy clients."""

    max_body_bytes: StrictInt = Field(default=8 << 20, gt=0, le=1 << 30)
    """A request body over this is refused (413) as it arrives, chunked or not."""
    header_timeout_s: StrictFloat = Field(default=10.0, gt=0, le=3_600)
    """A connection must send a whole request head (and finish its TLS
    handshake) within this of connecting or of its previous response, or it is closed."""
    body_timeout_s: StrictFloat = Field(default=30.0, gt=0, le=_DAY_S)
    """A request body must arrive whole within this of its head (408 otherwise)."""
    max_connections: StrictInt = Field(default=1024, gt=0, le=1_000_000)
    """Open connections at most; one more gets 503 and is closed."""
    max_connections_per_client: StrictInt = Field(default=256, gt=0, le=1_000_000)
    """Open connections from one client address at most; one more gets 429 and is closed."""


@dataclass(slots=True, config=SECTION_CONFIG)
class ApiSection(ConfigSection):
    """Bounds of the public API (``router.api``), shared by gRPC, HTTP and jobs."""

    max_prompt_bytes: StrictInt = Field(default=1 << 20, gt=0, le=1 << 30)
    """A prompt (or chat messages) over this many UTF-8 bytes is refused before tokenizing."""
    max_message_bytes: StrictInt = Field(default=16 << 20, gt=0, le=1 << 30)
    """Largest gRPC message the public listener takes (the internal one takes 64 MiB);
    a batch job's requests travel in one message (at most 15 MiB, router/frontends/jobs.py)."""
    max_concurrent_rpcs: StrictInt = Field(default=1024, gt=0, le=1_000_000)
    """gRPC calls the public listener serves at once; more get RESOURCE_EXHAUSTED."""
    tokenizer_threads: StrictInt = Field(default=2, gt=0, le=256)
    """Threads that tokenize prompts, off the router's event loop."""


@dataclass(slots=True, config=SECTION_CONFIG)
class LivenessSection(ConfigSection):
    """How the cluster notices what stopped (``router.liveness``): heartbeats, link probes, KV leases."""

    heartbeat_interval_s: StrictFloat = Field(default=1.0, gt=0, le=3_600)
    """How often workers report load."""
    worker_timeout_s: StrictFloat = Field(default=5.0, gt=0, le=_DAY_S)
    """A worker silent this long is unhealthy and gets no requests."""
    link_probe_timeout_s: StrictFloat = Field(default=1.0, gt=0, le=3_600)
    """Each heartbeat, every worker TCP-connects to a worker in each site linked
    to its own; a connect slower than this marks the link down (placement stops
    using it and transfers on it are re-placed) until a probe succeeds again.
    At most half of ``worker_timeout_s`` (a heartbeat waits for the probes)."""
    kv_lease_s: StrictFloat = Field(default=30.0, gt=0, le=_DAY_S)
    """A decode worker frees a reservation whose KV has not arrived by then."""

    def __post_init__(self) -> None:
        if self.link_probe_timeout_s > self.worker_timeout_s / 2:
            raise FieldError("link_probe_timeout_s", f"must be at most half of worker_timeout_s "
                             f"({self.worker_timeout_s / 2:g}): a heartbeat waits for the probes")


@dataclass(slots=True, config=SECTION_CONFIG)
class AdmissionSection(ConfigSection):
    """How many requests the router keeps on each worker, and who waits how long (``router.admission``)."""

    max_inflight_per_worker: StrictInt = Field(default=64, ge=1, le=65_536)
    """Admission bound: requests the router keeps on one worker at once; when
    every eligible worker is full, requests get RESOURCE_EXHAUSTED with a retry hint."""
    interactive_reserve: StrictInt = Field(default=1, ge=0, le=65_535)
    """Slots of every worker's max_inflight_per_worker that batch requests leave
    free, so an interactive request finds room at once however busy jobs keep it.
    Below max_inflight_per_worker."""
    job_concurrency: StrictInt = Field(default=4, ge=1, le=4_096)
    """Job requests the router runs at once (only while no interactive request waits)."""
    admission_wait_s: StrictFloat = Field(default=60.0, gt=0, le=_DAY_S)
    """A request that finds every eligible decode worker full waits at the router
    for room up to this long (never past its own deadline), then gets
    RESOURCE_EXHAUSTED with a retry hint."""
    unavailable_wait_s: StrictFloat = Field(default=10.0, gt=0, le=_DAY_S)
    """A request that finds no healthy decode worker it may use (workers
    restarting, or a router that just restarted and awaits their heartbeats)
    waits for one up to this long (never past its deadline), then gets UNAVAILABLE."""
    shed_early: StrictBool = True
    """A request that would wait for room is refused at once (RESOURCE_EXHAUSTED with a retry
    hint) when, at the rate the router's queue has been served, its turn would come only after
    it may wait (its deadline or admission_wait_s): refused early, not lost late
    (router/core/admission.py)."""

    def __post_init__(self) -> None:
        if self.interactive_reserve >= self.max_inflight_per_worker:
            raise FieldError("interactive_reserve", f"must be in [0, max_inflight_per_worker), got "
                                                    f"{self.interactive_reserve}")


@dataclass(slots=True, config=SECTION_CONFIG)
class LinkRatesSection(ConfigSection):
    """How the router measures each link from the transfers that cross it (``router.placement.link_rates``;
    router/placement/link_estimate.py): once measured, placement and ``kv_codec: auto`` use these figures
    in place of the config's ``gbps`` and ``rtt_ms``."""

    measure: StrictBool = True
    """Use measured figures (false: the config's figures always)."""
    alpha: StrictFloat = Field(default=0.5, gt=0, le=1)
    """Weight of each new link-bound transfer in the rate's moving average."""
    min_samples: StrictInt = Field(default=2, ge=1, le=1000)
    """Link-bound transfers before the measured rate replaces the configured one."""
    max_age_s: StrictFloat = Field(default=120.0, gt=0, le=_DAY_S)
    """A link with no transfer for this long goes back to its configured figures."""


@dataclass(slots=True, config=SECTION_CONFIG)
class PlacementSection(ConfigSection):
    """Where the router places each request (``router.placement``; router/placement)."""

    policy: Policy = PlacementPolicy.COST_MODEL
    """Placement policy: round_robin, least_loaded, prefix_aware or cost_model."""
    colocate_below_tokens: StrictInt = Field(default=32, ge=0, le=MAX_TOKENS)
    """Prompts shorter than this are prefilled by their decode worker."""
    default_prefill_tokens_per_s: StrictFloat = Field(default=1000.0, gt=0, le=1_000_000_000)
    """Prefill throughput assumed for a worker until it has measured its own."""
    herd_tolerance: StrictFloat = Field(default=0.05, ge=0, le=1)
    """cost_model picks at random among candidates within this fraction of the
    best estimate, so simultaneous requests do not all pile onto one worker."""
    link_rates: LinkRatesSection = field(default_factory=LinkRatesSection)
    """Links' rates and RTTs measured from their transfers."""


@dataclass(slots=True, config=SECTION_CONFIG)
class PoolSizingSection(ConfigSection):
    """How the worker pools are sized (``router.pools``): who sets their sizes,
    the objectives the planner sizes them for, and how a removed worker leaves."""

    scaling: Scaling = ScalingOwner.KVRELAY
    """Who sets pool sizes: kvrelay (its launchers follow `kvrelay scale`) or
    external (an orchestrator such as Kubernetes; `kvrelay scale` is refused)."""
    slo_ttft_s: StrictFloat = Field(default=2.0, gt=0, le=3_600)
    """Time-to-first-token objective the planner sizes prefill pools for."""
    slo_tpot_s: StrictFloat = Field(default=0.2, gt=0, le=3_600)
    """Time-per-output-token objective the planner sizes decode pools for."""
    planner_window_s: StrictFloat = Field(default=60.0, gt=0, le=_DAY_S)
    """Recent requests the planner's figures cover."""
    drain_timeout_s: StrictFloat = Field(default=600.0, gt=0, le=_DAY_S)
    """A draining worker (scale-down, `kvrelay drain`) leaves after this even
    if requests remain; until then it finishes what it holds."""


@dataclass(slots=True, config=SECTION_CONFIG)
class RecordsSection(ConfigSection):
    """What the router keeps on disk, and for how long (``router.records``)."""

    jobs_db: StrictStr | None = None
    """SQLite file holding batch jobs and their results (durable across router
    restarts); None = `kvrelay serve` uses jobs.sqlite in the cache folder."""
    audit_log: StrictStr | None = None
    """Append-only, hash-chained JSONL audit log (one record per request and
    per operator action); None = `kvrelay serve` uses audit.jsonl in the cache folder."""
    audit_signing_key: StrictStr | None = None
    """Ed25519 private key (PEM) that signs the audit log's head when the router opens
    the log, every ``audit_head_interval_s`` while it moves, and when it closes it
    (router/governance/audit_heads.py); keep it apart from the log (another folder and
    owner). None = `kvrelay serve` makes one in its keys folder; a router started alone
    without it signs nothing."""
    audit_heads: StrictStr | None = None
    """File the signed heads are appended to (JSONL), for another party to keep; each
    is also logged (logger kvrelay.audit.heads). None = ``<audit_log>.heads`` beside the log."""
    audit_head_interval_s: StrictFloat = Field(default=60.0, gt=0, le=_DAY_S)
    """Most seconds between two signed heads while records are written."""
    usage_db: StrictStr | None = None
    """SQLite file of usage accounting (the workers' own counters, per minute);
    None = `kvrelay serve` uses usage.sqlite in the cache folder."""
    retention_sweep_s: StrictFloat = Field(default=3600.0, gt=0, le=_DAY_S)
    """How often the retention sweeper deletes jobs and audit records past their tenant's retention."""
    operator_audit_retention_days: StrictFloat = Field(default=365.0, gt=0, le=36_500)
    """Retention of audit records that belong to no tenant (operator actions, worker registrations)."""
    min_free_bytes_for_jobs: StrictInt = Field(default=512 << 20, ge=0, le=1 << 50)
    """Free space the filesystems of these files keep: below it, new batch jobs are
    refused (RESOURCE_EXHAUSTED), so jobs never take the room audit records need."""
    min_free_bytes: StrictInt = Field(default=64 << 20, ge=0, le=1 << 50)
    """Below this much free space every new request is refused (UNAVAILABLE) rather
    than served without its audit record. At most ``min_free_bytes_for_jobs``."""

    def __post_init__(self) -> None:
        if self.min_free_bytes > self.min_free_bytes_for_jobs:
            raise FieldError("min_free_bytes", f"{self.min_free_bytes} is more than min_free_bytes_for_jobs "
                                               f"({self.min_free_bytes_for_jobs}): jobs stop first, then requests")


ROUTER_SECTIONS = {"liveness": LivenessSection, "admission": AdmissionSection, "placement": PlacementSection,
                   "pools": PoolSizingSection, "records": RecordsSection}
"""The router's sections by concern, whose fields were the router's own until they moved there."""


@dataclass(slots=True, config=SECTION_CONFIG)
class RouterSection(ConfigSection):
    """The router: where it listens, and its sections by concern."""

    MOVED: ClassVar[dict[str, str]] = {name: f"moved to router.{where}.{name}" for where, cls in ROUTER_SECTIONS.items()
                                       for name in (f.name for f in dataclasses.fields(cls))}
    """The router's fields of before its sections (``router.policy``), each naming its new place."""

    site: StrictStr | None = None
    """The site the router runs at (it tokenizes every prompt and keeps the
    jobs and audit files): the data-handling statement names its jurisdiction.
    None: not declared (the statement says so)."""
    host: StrictStr = "127.0.0.1"
    """Address the router's gRPC server binds."""
    port: StrictInt = Field(default=50051, ge=0, le=65_535)
    """Port of the gRPC server; 0 picks a free one."""
    http_port: StrictInt | None = Field(default=8000, ge=0, le=65_535)
    """Port of the OpenAI-compatible HTTP API (same host); 0 picks a free one;
    null turns it off."""
    internal_port: StrictInt = Field(default=50052, ge=0, le=65_535)
    """Mutual-TLS listener for workers (Registry) and certificate holders
    (operators, tenants with client certificates); 0 = any free port."""
    liveness: LivenessSection = field(default_factory=LivenessSection)
    """Heartbeats, link probes and KV leases: how the cluster notices what stopped."""
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    """Requests kept on each worker, the slots left to interactive requests, and how long requests wait."""
    placement: PlacementSection = field(default_factory=PlacementSection)
    """The placement policy and what it assumes."""
    pools: PoolSizingSection = field(default_factory=PoolSizingSection)
    """Who sizes the worker pools, for which objectives, and how a removed worker leaves."""
    records: RecordsSection = field(default_factory=RecordsSection)
    """The jobs, audit and usage files, and how long records are kept."""
    http: HttpSection = field(default_factory=HttpSection)
    """Bounds of the HTTP API: body size, header and body deadlines, connections."""
    api: ApiSection = field(default_factory=ApiSection)
    """Bounds of the public API: prompt bytes, gRPC message size and concurrent calls, tokenizer threads."""


BUILTIN_START_TIMEOUT_S = 240.0
VLLM_START_TIMEOUT_S = 1_800.0
"""Defaults of ``PoolSection.start_timeout_s``."""


@dataclass(slots=True, config=SECTION_CONFIG)
class PoolSection(ConfigSection):
    replicas: StrictInt = Field(default=1, le=_MAX_REPLICAS, json_schema_extra={"minimum": 0})
    """Workers of this role at the site (at start; `kvrelay scale` changes it). In [0, max_replicas]."""
    max_replicas: StrictInt = Field(default=16, ge=0, le=_MAX_REPLICAS)
    """Operator limit: `kvrelay scale` refuses more than this."""
    min_replicas: StrictInt = Field(default=0, le=_MAX_REPLICAS, json_schema_extra={"minimum": 0})
    """Operator limit for the planner (`kvrelay plan`): it never recommends fewer. In [0, max_replicas]."""
    device: StrictStr | None = None
    """cpu or cuda[:N] for this pool; None = model.device."""
    tenants: StringList = field(default_factory=list)
    """Dedicated pool: only these tenants' requests are placed on it. Empty: shared by every tenant."""
    engine: EngineField = EngineKind.BUILTIN
    """What computes this pool's requests: builtin (kvrelay's engine) or vllm (needs vLLM installed)."""
    vllm: VllmSection | None = None
    """vLLM's engine arguments (engine: vllm only); None = every default."""
    start_timeout_s: StrictFloat | None = Field(default=None, gt=0, le=_DAY_S)
    """How long a worker of this pool may take from its start to its registration before the launcher
    (local processes or Ray) stops it and starts another; None = 240 s for the builtin engine, 1,800 s
    for vLLM (a large checkpoint's load, its compilation and CUDA graph capture on a GPU). On
    Kubernetes it bounds the pool's pods' startup probe (None there: the chart's probes.startupSeconds)."""

    def start_timeout(self) -> float:
        """start_timeout_s, or its default for the pool's engine."""
        if self.start_timeout_s is not None:
            return self.start_timeout_s
        return VLLM_START_TIMEOUT_S if self.engine is EngineKind.VLLM else BUILTIN_START_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.vllm is not None and self.engine is not EngineKind.VLLM:
            raise FieldError("vllm", f"engine arguments for vLLM on a pool whose engine is {self.engine}; "
                                     "set engine: vllm, or remove the section")
        for name in ("min_replicas", "replicas"):  # their lower bound 0 depends on max_replicas: checked here
            if getattr(self, name) < -_MAX_REPLICAS:  # past the bound's size, as for every other field
                raise FieldError(name, f"must be >= 0, got {show(getattr(self, name))}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise FieldError("min_replicas", f"must be in [0, max_replicas], got {self.min_replicas}")
        if not 0 <= self.replicas <= self.max_replicas:
            raise FieldError("replicas", f"must be in [0, max_replicas={self.max_replicas}], got {self.replicas}")
        if self.device is not None and not _DEVICE.fullmatch(self.device):
            raise FieldError("device", f"must be cpu or cuda[:N], got {self.device!r}")


_ENCRYPT = {"encrypt": "replaced by protection: aead | integrity; every link is encrypted unless it says integrity"}


@dataclass(slots=True, config=SECTION_CONFIG)
class LinkSection(ConfigSection):
    """A network link between two sites (or, as ``local_link``, within a site)."""

    MOVED: ClassVar[dict[str, str]] = _ENCRYPT

    between: StringList = field(default_factory=list)
    """The two site names (empty for local_link)."""
    rtt_ms: StrictFloat = Field(default=0.2, ge=0, le=60_000)
    """Round-trip time (a minute at most)."""
    gbps: StrictFloat = Field(default=10.0, gt=0, le=10_000)
    """Bandwidth available to KV transfers, Gbit/s (10 Tbit/s at most)."""
    transport: LinkTransport | None = None
    """KV transport on this link: tcp, nixl or local; None = kv.transport."""
    protection: ProtectionField | None = None
    """KV protection on this link: aead (encrypted and authenticated) or
    integrity (authenticated, readable); None = kv.protection. Receivers
    enforce it for senders whose certificate names the other end's site."""
    kv_codec: CodecField = KVCodec.NONE
    """KV codec on this link (kvtransfer/codecs.py): none (the cache's bytes), or fewer bytes with a
    measured loss: int8 and fp8 (1.94x smaller than bf16), int4 (3.56x); benchmarks/RESULTS.md, "KV
    codecs' cost in answers"; or auto: per request, the least lossy of ``kv.auto_codecs`` whose estimated
    exposed transfer is within a few ms of the fastest's (router/placement/codec_choice.py). Bytes over tcp
    (a coded link never pulls); builtin-engine pools only; tenants with kv_lossy false always get none."""


@dataclass(slots=True, config=SECTION_CONFIG)
class SiteSection(ConfigSection):
    name: StrictStr
    """Site name, e.g. toronto."""
    jurisdiction: StrictStr = "unspecified"
    """Where data at this site is processed, e.g. CA-ON."""
    prefill: PoolSection = field(default_factory=PoolSection)
    decode: PoolSection = field(default_factory=PoolSection)

    def pool(self, role: Role) -> PoolSection:
        """The site's pool of ``role`` workers."""
        return self.prefill if role is Role.PREFILL else self.decode

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise FieldError("name", f"{self.name!r} must be lowercase letters, digits, - or _")


@dataclass(slots=True, config=SECTION_CONFIG)
class WorkerSection(ConfigSection):
    host: StrictStr = "127.0.0.1"
    """Address workers bind and advertise (gRPC and KV receiver); "auto" = each
    worker's own address on the route to the router (multi-node, e.g. Ray)."""
    threads: StrictInt | None = Field(default=None, ge=1, le=1_024)
    """torch threads per worker; None = torch's default."""
    fail_engine_worker: StrictStr | None = None
    """Fault injection (tests and chaos only, never for service): the worker
    with this id has its engine step number ``fail_engine_at_step`` raise."""
    fail_engine_at_step: StrictInt = Field(default=1, ge=1, le=1_000_000_000)


@dataclass(slots=True, config=SECTION_CONFIG)
class KVSection(ConfigSection):
    MOVED: ClassVar[dict[str, str]] = _ENCRYPT

    transport: KVTransportField = AUTO
    """KV transport: auto (nixl where the host has RDMA, else tcp), tcp, nixl or local."""
    streams: StrictInt = Field(default=4, ge=1, le=64)
    """Parallel TCP connections per peer."""
    socket_buffer_bytes: StrictInt | None = Field(default=None, ge=0, le=1 << 30)
    """TCP socket buffers; size to the link's bandwidth-delay product (None = kernel default)."""
    secret_file: StrictStr | None = None
    """File holding the deployment secret that authenticates KV connections;
    None = `kvrelay serve` makes a random one per run and hands it to its workers."""
    transfer_timeout_s: StrictFloat = Field(default=30.0, gt=0, le=_DAY_S)
    """A prefill worker gives up on (and frees the blocks of) a transfer not acknowledged by then."""
    protection: ProtectionField = Protection.AEAD
    """KV protection of links that name none: aead (AES-256-GCM, or
    ChaCha20-Poly1305 without AES instructions, over every frame) or integrity
    (a MAC over every frame, for links inside one machine room)."""
    corrupt_first_transfers: StrictInt = Field(default=0, ge=0, le=1_000_000_000)
    """Fault injection (tests, chaos runs; never in service): each prefill worker
    flips one sealed byte of the first N KV transfers it sends (as an on-path
    attacker would), so that receivers must detect and refuse them."""
    auto_codecs: StringList = field(default_factory=lambda: [KVCodec.NONE.value, KVCodec.INT8.value])
    """The codecs a link with ``kv_codec: auto`` may choose from: the deployment's quality floor (int8
    kept 85% of 32-token greedy answers, fp8 44%, int4 15% on SmolLM2: benchmarks/RESULTS.md)."""

    def __post_init__(self) -> None:
        if not self.auto_codecs:
            raise FieldError("auto_codecs", "must name at least one codec (none: never lossy)")
        for i, name in enumerate(self.auto_codecs):
            if name not in set(KVCodec):
                raise FieldError(f"auto_codecs[{i}]", f"must be {_one_of(KVCodec)}, got {name!r}")


@dataclass(slots=True, config=SECTION_CONFIG)
class Credential(ConfigSection):
    name: StrictStr
    """Who holds the token (shown in logs)."""
    token_sha256: StrictStr
    """Hex SHA-256 of the bearer token; the token itself is never stored.
    `kvrelay token` makes a token and prints this line for it."""

    def __post_init__(self) -> None:
        if not _SHA256.fullmatch(self.token_sha256):
            raise FieldError("token_sha256", "must be 64 lowercase hex digits "
                                             "(the SHA-256 of the token; `kvrelay token` prints one)")


@dataclass(slots=True, config=SECTION_CONFIG)
class AuthSection(ConfigSection):
    MOVED: ClassVar[dict[str, str]] = {"clients": "moved to the top-level tenants: [{name, token_sha256, ...policy}]"}

    operators: Annotated[list[Credential], _entries(Credential, "credentials")] = field(default_factory=list)
    """Who may call the Admin API (kvrelay scale / drain / pools). Empty:
    `kvrelay serve` makes a token for this run and writes it to a file only
    its user can read."""
    allow_anonymous: StrictBool = False
    """Serve clients that present no credentials (all of them one tenant,
    "anonymous", with the policy of a ``tenants`` entry of that name if there
    is one). Refused unless every listener is on a loopback address."""

    def __post_init__(self) -> None:
        names = set()
        for i, cred in enumerate(self.operators):
            if not cred.name or cred.name in names:
                raise FieldError(f"operators[{i}].name", f"must be non-empty and unique, got {cred.name!r}")
            names.add(cred.name)


OIDC_ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512",
                             "EdDSA"})
"""Signature algorithms an OpenID provider's tokens may use: asymmetric only (never ``none``, never
HS*: a shared secret would let this service mint tokens, and invites algorithm confusion)."""


@dataclass(slots=True, config=SECTION_CONFIG)
class ClaimRule(ConfigSection):
    """A token whose ``claim`` holds ``value`` (equal to a string claim, or a member of a
    list claim) acts as ``tenant``, or as operator ``operator``; exactly one of the two."""

    claim: StrictStr
    """The claim's name, e.g. ``groups``, ``eduperson_entitlement``, ``sub``."""
    value: StrictStr
    """The value it must hold (compared exactly)."""
    tenant: StrictStr | None = None
    """The tenant (of ``tenants``) such a token acts as."""
    operator: StrictStr | None = None
    """Or: such a token is an operator's, named this in logs and audit records."""

    def __post_init__(self) -> None:
        if (self.tenant is None) == (self.operator is None):
            raise FieldError("tenant", "give exactly one of tenant and operator")
        if not self.claim or not self.value:
            raise FieldError("claim" if not self.claim else "value", "must not be empty")


def oidc_url_allowed(url: str) -> bool:
    """Whether an OpenID provider's document or keys may be fetched from ``url``: https, or http on
    a loopback host (a provider on this machine, as in tests). Held to by the config's URLs, the
    ``jwks_uri`` a discovery document names, and every redirect (router/core/oidc.py)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "https" and parsed.hostname:
        return True
    return parsed.scheme == "http" and parsed.hostname in ("127.0.0.1", "::1", "localhost")


def _check_oidc_url(field_name: str, url: str) -> None:
    if not oidc_url_allowed(url):
        raise FieldError(field_name, f"must be an https URL (http only on a loopback host), got {url!r}")


@dataclass(slots=True, config=SECTION_CONFIG)
class OIDCProviderSection(ConfigSection):
    """An OpenID Connect provider whose access tokens (JWT) are bearer credentials
    on gRPC and HTTP (router/core/oidc.py checks each as a resource server must)."""

    name: StrictStr
    """Short name, in logs and errors."""
    issuer: StrictStr
    """The tokens' ``iss``, exactly; its discovery document (``/.well-known/openid-configuration``)
    names the keys unless ``jwks_uri`` does."""
    audience: StrictStr
    """The ``aud`` tokens must carry for this service (the resource the provider issues them for)."""
    rules: Annotated[list[ClaimRule], _entries(ClaimRule, "claim rules", may_be_empty=False)]
    """Claims to tenant or operator, in order: the first that matches decides; none: refused."""
    algorithms: list[StrictStr] = field(default_factory=lambda: ["RS256", "ES256"])
    """Signature algorithms accepted (of RS*, PS*, ES*, EdDSA)."""
    jwks_uri: StrictStr | None = None
    """Where the provider publishes its keys; None: from its discovery document."""
    jwks_refresh_s: StrictFloat = Field(default=300.0, gt=0, le=_DAY_S)
    """How often the keys are fetched again (a token with an unknown key id fetches them at once,
    at most every few seconds)."""
    jwks_max_age_s: StrictFloat = Field(default=_DAY_S, gt=0, le=30 * _DAY_S)
    """Keys fetched are used this long after the last fetch that succeeded, while the provider
    cannot be reached; after it, its tokens are refused."""
    clock_skew_s: StrictFloat = Field(default=60.0, ge=0, le=600)
    """Leeway on ``exp``, ``nbf`` and ``iat``."""
    ca: StrictStr | None = None
    """CA bundle (PEM) for the provider's https; None: the system's."""
    timeout_s: StrictFloat = Field(default=5.0, gt=0, le=60)
    """Deadline of one fetch of the discovery document or the keys."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise FieldError("name", f"must be 1-64 letters, digits, '.', '_' or '-', got {self.name!r}")
        _check_oidc_url("issuer", self.issuer)
        if self.jwks_uri is not None:
            _check_oidc_url("jwks_uri", self.jwks_uri)
        if not self.audience:
            raise FieldError("audience", "must not be empty")
        if self.jwks_max_age_s < self.jwks_refresh_s:
            raise FieldError("jwks_max_age_s", f"{self.jwks_max_age_s:g} is less than jwks_refresh_s "
                                               f"({self.jwks_refresh_s:g}): keys would lapse before their next fetch")
        bad = [a for a in self.algorithms if a not in OIDC_ALGORITHMS]
        if bad or not self.algorithms:
            raise FieldError("algorithms", f"{bad[0] if bad else 'an empty list'!r} is not accepted: give some of "
                                           f"{', '.join(sorted(OIDC_ALGORITHMS))} (never none or HS*)")


@dataclass(slots=True, config=SECTION_CONFIG)
class IdentitySection(ConfigSection):
    """Identity beyond static tokens and certificates."""

    oidc: Annotated[list[OIDCProviderSection], _entries(OIDCProviderSection, "OpenID providers")] = field(
        default_factory=list)
    """OpenID Connect providers whose access tokens are accepted (none by default)."""


@dataclass(slots=True, config=SECTION_CONFIG)
class TLSSection(ConfigSection):
    """Certificates of the cluster PKI (``kvrelay pki``). Every gRPC and HTTP
    listener speaks TLS; internal ones (Registry, workers) mutual TLS."""

    enabled: StrictBool = True
    """False: plaintext everywhere (comparisons on one machine); refused
    unless every listener is on a loopback address."""
    ca: StrictStr | None = None
    """CA bundle (PEM) every process trusts, followed while it runs (``kvrelay pki
    rotate-ca`` adds a new CA to it). None: `kvrelay serve` uses the per-user CA it
    makes under the cache folder."""
    ca_key: StrictStr | None = None
    """The CA's key: the launcher then issues a certificate to each process it
    starts. Without it, each process uses ``cert``/``key``."""
    cert: StrictStr | None = None
    """This process's certificate (PEM), when the launcher does not issue one; followed
    while it runs with ``key`` (a renewal written there is taken without a restart)."""
    key: StrictStr | None = None
    """Its private key (PEM, unencrypted, readable by this user only)."""
    cert_days: StrictFloat = Field(default=30.0, gt=0, le=3_650)
    """Lifetime of the certificates the launcher and `kvrelay pki issue` make (ten years at most);
    the launcher issues each process's next one after two thirds of it."""
    revoked_serials: StringList = field(default_factory=list)
    """Serials (hex, as `kvrelay pki show` prints them) refused although the CA signed them."""
    server_names: StringList = field(default_factory=list)
    """More DNS names or IP addresses for the router's server certificate
    (its host, localhost and 127.0.0.1 are always in it)."""
    router_identity: StrictStr | None = None
    """``kvrelay://<site>/router/<name>``: the one router certificate workers admit
    and accept when they dial the router. None: the router a launcher or the Helm
    chart starts, ``kvrelay://<router.site, else the first site>/router/0``."""

    def __post_init__(self) -> None:
        if self.router_identity is not None and not re.fullmatch(
                r"kvrelay://[a-z0-9_-]{1,63}/router/[a-z0-9_-]{1,63}", self.router_identity):
            raise FieldError("router_identity", f"must be kvrelay://<site>/router/<name>, got {self.router_identity!r}")
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


Traces = Annotated[TraceExport, choice(TraceExport, _one_of(TraceExport))]


@dataclass(slots=True, config=SECTION_CONFIG)
class TelemetrySection(ConfigSection):
    """Traces (OpenTelemetry) and metrics (Prometheus) of every process."""

    traces: Traces = TraceExport.NONE
    """none | otlp | file."""
    endpoint: StrictStr | None = None
    """OTLP collector, ``https://host:4317`` (TLS) or ``http://`` to a loopback
    address only (spans name tenants, sites and workers)."""
    ca_file: StrictStr | None = None
    """CA bundle that signs an ``https://`` collector's certificate (None: the system's roots)."""
    file: StrictStr = "kvrelay-traces/{process}.jsonl"
    """The JSONL file of each process; ``{process}`` becomes ``router`` or the
    worker (``toronto-decode-0``). Relative paths are from the process's directory."""
    file_max_bytes: StrictInt = Field(default=256 << 20, ge=1 << 20, le=1 << 40)
    """A process's trace file is moved to ``<name>.1.jsonl`` (replacing the one
    before) when it reaches this size (at least 1 MiB), so spans never fill the disk."""
    sample_ratio: StrictFloat = Field(default=1.0, ge=0, le=1)
    """Share of requests traced, in [0, 1], drawn on the router's own random trace ids (a client's
    ``traceparent`` is a link of the request's root, never its trace, and decides nothing)."""
    metrics_host: StrictStr = "127.0.0.1"
    """Where every process serves /metrics. A non-loopback address needs
    ``metrics_exposed: true``: the exposition is plaintext HTTP without credentials."""
    metrics_exposed: StrictBool = False
    """Allow a non-loopback ``metrics_host`` (behind a network policy that admits only the scraper)."""
    router_metrics_port: StrictInt | None = Field(default=0, ge=0, le=65_535)
    """The router's /metrics port; 0 = any free port, null = no metrics."""
    worker_metrics_port: StrictInt | None = Field(default=0, ge=0, le=65_535)
    """Each worker's /metrics port (0 = any free port, advertised when it registers; null = none).
    A fixed port suits one worker per host or pod (Kubernetes), not several."""
    prometheus_targets: StrictStr | None = None
    """A Prometheus ``file_sd`` JSON file the router keeps up to date with every
    process's /metrics address (labels: role, site, worker); None = not written."""

    def __post_init__(self) -> None:
        if self.traces is TraceExport.OTLP:
            _check_collector(self.endpoint)
        elif self.endpoint is not None or self.ca_file is not None:
            raise FieldError("endpoint" if self.endpoint is not None else "ca_file",
                             f"is only used with traces: otlp (traces is {self.traces.value})")
        if self.ca_file is not None and (self.endpoint or "").startswith("http://"):
            raise FieldError("ca_file", "is only used with an https:// endpoint")
        _check_file_template(self.file)
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


@dataclass(slots=True, config=SECTION_CONFIG)
class HealthSection(ConfigSection):
    """``/livez`` and ``/readyz`` of every process (runtime/health.py), for an
    orchestrator's probes. Off by default; the Helm chart turns it on."""

    host: StrictStr = "127.0.0.1"
    """Where the probe listeners bind (0.0.0.0 in a pod: the kubelet probes the pod's address).
    The answers carry no data beyond ok or a one-line reason, so any address is allowed."""
    router_port: StrictInt | None = Field(default=None, ge=0, le=65_535)
    """The router's probe port; 0 = any free port, null = none."""
    worker_port: StrictInt | None = Field(default=None, ge=0, le=65_535)
    """Each worker's probe port (a fixed one suits one worker per pod); null = none."""


@dataclass(slots=True, config=SECTION_CONFIG)
class RouterEntrySection(ConfigSection):
    """One router of a deployment with several (``routers:``): every router serves the
    public APIs and places on every worker; its site is where the prompts it receives
    are read. Its listeners replace ``router:``'s own host and ports."""

    name: StrictStr
    """Its name (its certificate is kvrelay://<site>/router/<name>; `python -m kvrelay.router --name`)."""
    site: StrictStr
    """The site it runs at (a site of ``sites:``)."""
    host: StrictStr = "127.0.0.1"
    """Address its listeners bind."""
    port: StrictInt = Field(default=50051, ge=0, le=65_535)
    """Public gRPC port; 0 picks a free one (the router announces the one it got in etcd)."""
    internal_port: StrictInt = Field(default=50052, ge=0, le=65_535)
    """Mutual-TLS port (workers, certificate holders); 0 = any free port."""
    http_port: StrictInt | None = Field(default=8000, ge=0, le=65_535)
    """HTTP API port; 0 = any free port; null turns it off."""
    advertise: StrictStr | None = None
    """The host name or address workers, clients and the other routers reach it by (its certificate
    must name it: ``tls.server_names``). None: ``host``, which must then not be a wildcard."""

    def __post_init__(self) -> None:
        for name, value in (("name", self.name), ("site", self.site)):
            if not _NAME.match(value):
                raise FieldError(name, f"{value!r} must be lowercase letters, digits, - or _")
        if self.advertise is None and self.host in ("0.0.0.0", "::", ""):
            raise FieldError("advertise", f"required when host is {self.host!r} (every address of the machine): "
                                          "the name or address the others reach this router by")

    def reachable(self, address: str) -> str:
        """``address`` (host:port as bound) as the others reach it: its port at ``advertise``."""
        if self.advertise is None:
            return address
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"{host}:{address.rpartition(':')[2]}"

    @property
    def uri(self) -> str:
        """The identity its certificate names."""
        return f"kvrelay://{self.site}/router/{self.name}"


@dataclass(slots=True, config=SECTION_CONFIG)
class EtcdSection(ConfigSection):
    """The store the routers of a deployment with several share (membership, workers,
    drains): etcd's v3 API over TLS, each router presenting its certificate from the
    cluster CA (``tls``). Unused with one router."""

    endpoints: StringList = field(default_factory=list)
    """host:port of the deployment's etcd members (client URLs). Empty: `kvrelay serve`
    starts ``members`` of them on this machine and fills this in for its routers."""
    members: StrictInt = Field(default=3, ge=1, le=7)
    """How many members `kvrelay serve` starts when ``endpoints`` is empty (odd: a majority survives)."""
    prefix: StrictStr = "/kvrelay/"
    """Every key kvrelay writes starts with it (several deployments may share one etcd)."""
    lease_ttl_s: StrictInt = Field(default=6, ge=2, le=300)
    """A router that stops renewing its lease leaves the membership this long after."""
    timeout_s: StrictFloat = Field(default=5.0, gt=0, le=120)
    """Deadline of each call to etcd; at start, how long a router tries to reach it."""

    def __post_init__(self) -> None:
        if self.members % 2 == 0:
            raise FieldError("members", f"must be odd (a majority must survive a member's loss), got {self.members}")
        if self.endpoints and self.members != 3:
            raise FieldError("members", "is how many members kvrelay serve starts when endpoints is empty; with "
                                        "endpoints given, your etcd's members are those endpoints")
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise FieldError("prefix", f"must start and end with /, got {self.prefix!r}")
        for i, ep in enumerate(self.endpoints):
            if not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d{1,5}", ep):
                raise FieldError(f"endpoints[{i}]", f"must be host:port, got {ep!r}")


@dataclass(slots=True, config=SECTION_CONFIG)
class PostgresSection(ConfigSection):
    """Where the routers of a deployment with several keep batch jobs (their requests and
    results): a PostgreSQL primary with streaming standbys, every connection TLS with the
    router's certificate from the cluster CA (router/core/shared_jobs.py). Unused with one
    router (its jobs are in router.records.jobs_db)."""

    endpoints: StringList = field(default_factory=list)
    """host:port of the primary and its standbys, in any order: a router writes to whichever
    accepts writes (a promoted standby, after a failover). Empty: `kvrelay serve` starts a
    primary and ``standbys`` on this machine and fills this in for its routers."""
    standbys: StrictInt = Field(default=1, ge=0, le=4)
    """How many streaming standbys `kvrelay serve` starts beside the primary when ``endpoints`` is empty."""
    database: StrictStr = "kvrelay"
    user: StrictStr = "kvrelay"
    """The role routers log in as (with TLS on, the server maps every router certificate to it)."""
    timeout_s: StrictFloat = Field(default=5.0, gt=0, le=120)
    """Deadline of connecting and of each statement (a lock never waited on longer)."""

    def __post_init__(self) -> None:
        if self.endpoints and self.standbys != 1:
            raise FieldError("standbys", "is how many standbys kvrelay serve starts when endpoints is empty; with "
                                         "endpoints given, your PostgreSQL's servers are those endpoints")
        for i, ep in enumerate(self.endpoints):
            if not re.fullmatch(r"[A-Za-z0-9.\-]+:\d{1,5}", ep):
                raise FieldError(f"endpoints[{i}]", f"must be host:port, got {ep!r}")
        for name in ("database", "user"):
            if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", getattr(self, name)):
                raise FieldError(name, f"must be a lowercase SQL identifier, got {getattr(self, name)!r}")


@dataclass(slots=True, config=SECTION_CONFIG)
class ClusterConfig(ConfigSection):
    model: ModelSection = field(default_factory=ModelSection)
    router: RouterSection = field(default_factory=RouterSection)
    routers: Annotated[list[RouterEntrySection], _entries(RouterEntrySection, "routers")] = field(
        default_factory=list)
    """The deployment's routers when it has several, each at a site (router/cluster/membership.py).
    Empty: one router, ``router:``'s, with no etcd (the local default)."""
    etcd: EtcdSection = field(default_factory=EtcdSection)
    """Where routers of a deployment with several share their state."""
    postgres: PostgresSection = field(default_factory=PostgresSection)
    """Where routers of a deployment with several keep batch jobs."""
    sites: Annotated[list[SiteSection], _entries(SiteSection, "sites", may_be_empty=False)] = field(
        default_factory=lambda: [SiteSection(name="local")])
    links: Annotated[list[LinkSection], _entries(LinkSection, "links")] = field(default_factory=list)
    """Links between sites; a pair of sites without one never exchanges KV."""
    local_link: LinkSection = field(default_factory=LinkSection)
    """The network between workers of one site."""
    workers: WorkerSection = field(default_factory=WorkerSection)
    kv: KVSection = field(default_factory=KVSection)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    auth: AuthSection = field(default_factory=AuthSection)
    identity: IdentitySection = field(default_factory=IdentitySection)
    """Federated identity: OpenID Connect providers (router/core/oidc.py)."""
    tls: TLSSection = field(default_factory=TLSSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    health: HealthSection = field(default_factory=HealthSection)
    """Probe endpoints of every process (off unless a port is set)."""
    tenants: Annotated[list[TenantSection], _entries(TenantSection, "tenants")] = field(default_factory=list)
    """Who may call the Inference and Jobs APIs (gRPC and HTTP), one entry per
    tenant with its credential and policy (runtime/tenants.py). Empty: nobody
    may, unless ``auth.allow_anonymous`` (`kvrelay serve` adds tenant ``local``)."""

    def tenant(self, name: str) -> TenantSection | None:
        """The policy of tenant ``name`` (None: not configured)."""
        return next((t for t in self.tenants if t.name == name), None)

    def router_entry(self, name: str) -> RouterEntrySection | None:
        """Router ``name`` of ``routers:`` (None: not listed)."""
        return next((r for r in self.routers if r.name == name), None)

    @property
    def router_uris(self) -> list[str]:
        """The identities of every router workers admit: each of ``routers:``, else the one router's."""
        return [r.uri for r in self.routers] or [self.router_uri]

    @property
    def router_uri(self) -> str:
        """The identity of the router workers admit (``tls.router_identity``, else the launcher's and chart's)."""
        return self.tls.router_identity or f"kvrelay://{self.router.site or self.sites[0].name}/router/0"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (enums as their string values), as YAML and JSON take it."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, enum.Enum) else value


# -- the bounds of each field, and pydantic's errors in our words ----------------------------------------------------
def _fields(cls: Any) -> dict[str, FieldInfo]:
    """The pydantic fields of section ``cls`` (none if it is not a section)."""
    return cls.__pydantic_fields__ if isinstance(cls, type) and is_pydantic_dataclass(cls) else {}


def _section_in(annotation: Any) -> Any:
    """The section class in a field's annotation (``X``, ``list[X]``, ``X | None``), else None."""
    if _fields(annotation):
        return annotation
    return next((a for a in get_args(annotation) if _fields(a)), None)


def sections(root: type = ClusterConfig) -> list[type]:
    """``root`` and every section class under it (list entries included), each once."""
    out, todo = [], [root]
    while todo:
        cls = todo.pop(0)
        if cls not in out:
            out.append(cls)
            todo += [s for info in _fields(cls).values() if (s := _section_in(info.annotation)) is not None]
    return out


def _bounds_of(info: FieldInfo) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            out["minimum"] = m.ge  # type: ignore[assignment]  # the bounds here are all numbers
        elif isinstance(m, annotated_types.Gt):
            out["exclusiveMinimum"] = m.gt  # type: ignore[assignment]
        elif isinstance(m, annotated_types.Le):
            out["maximum"] = m.le  # type: ignore[assignment]
    if isinstance(info.json_schema_extra, dict):  # a lower bound that a rule across fields checks (PoolSection)
        out |= {k: v for k, v in info.json_schema_extra.items() if k in ("minimum", "maximum")}  # type: ignore[misc]
    return out


def field_info(cls: type, name: str) -> FieldInfo:
    """What pydantic holds of field ``name`` of section ``cls`` (its docstring: engine/config.py ``field_docs``)."""
    return _fields(cls)[name]


def bounds(cls: type, name: str) -> dict[str, float]:
    """The bounds declared on field ``name`` of section ``cls``, as JSON schema
    says them: ``minimum`` (or ``exclusiveMinimum``) and ``maximum``; none for
    a field that is not a number."""
    return _bounds_of(field_info(cls, name))


def _field_at(loc: tuple) -> FieldInfo | None:
    """The field at ``loc`` (a pydantic error's location) under ClusterConfig."""
    cls: Any = ClusterConfig
    info = None
    for part in loc:
        if isinstance(part, int):
            continue
        info = _fields(cls).get(part)
        if info is None:
            return None
        cls = _section_in(info.annotation)
    return info


def _where(loc: tuple) -> str:
    """``sites[0].decode.replicas`` for pydantic's ``('sites', 0, 'decode', 'replicas')``; ``config`` for ()."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out or "config"


def _num(bound: float) -> str:
    """A bound as the config spells it (``3600``, not ``3600.0``)."""
    return str(int(bound)) if isinstance(bound, float) and bound.is_integer() else str(bound)


def _below(info: FieldInfo | None, value: Any) -> str:
    """Why ``value`` is under the lower bound of the field ``info``."""
    b = _bounds_of(info) if info is not None else {}
    if b.get("exclusiveMinimum") == 0:
        text = "must be positive"
    elif (b.get("minimum"), b.get("maximum")) == _PORT_BOUNDS:
        text = "must be a port in [0, 65535]"
    else:
        text = f"must be >= {_num(b.get('minimum', 0))}"
    nullable = info is not None and type(None) in get_args(info.annotation)
    return f"{text}{' or null' if nullable else ''}, got {show(value)}"


_EXPECTED = {"int_type": "expected an integer", "float_type": "expected a number",
             "bool_type": "expected true or false", "string_type": "expected a string"}


def _reason(err: ErrorDetails) -> str:
    """pydantic's error ``err`` in the config's words (the field's path not included)."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    info = _field_at(err["loc"])
    if kind in _EXPECTED and value is None:
        return "must not be null"
    if kind in ("int_type", "float_type") and (isinstance(value, _HugeInt) or type(value) is int):
        # digits past Python's limit (_HugeInt), or an integer past a float's range: beyond any bound
        upper = _bounds_of(info).get("maximum") if info is not None else None
        if (value.negative if isinstance(value, _HugeInt) else value < 0) or upper is None:
            return _below(info, value)
        return f"must be <= {_num(upper)}, got {show(value)}"
    if kind in _EXPECTED:
        return f"{_EXPECTED[kind]}, got {show(value)}"
    if kind == "finite_number":
        return f"must be a finite number, got {value}"
    if kind == "less_than_equal":
        return f"must be <= {_num(ctx['le'])}, got {show(value)}"
    if kind in ("greater_than_equal", "greater_than"):
        return _below(info, value)
    if kind == "missing":
        return "missing (a required field)"
    return err["msg"]


def _message(err: ErrorDetails) -> str:
    """The ConfigError message of pydantic's error ``err``: the field's path, then why."""
    where = _where(err["loc"])
    if err["type"] == "value_error":  # raised by a section (its __post_init__ or a check of its raw input)
        exc = err.get("ctx", {}).get("error")
        if isinstance(exc, FieldError):
            return f"{exc.name if where == 'config' else f'{where}.{exc.name}'}: {exc.reason}"
        return f"{where}: {exc}"
    return f"{where}: {_reason(err)}"


def _validate(cfg: ClusterConfig) -> None:
    """The rules that span sections (each section checked its own fields when built)."""
    sites = _check_sites(cfg.sites)
    if cfg.local_link.between:
        raise ConfigError("local_link.between: must be empty (it is the network inside every site)")
    _check_links(cfg.links, sites)
    _check_codec(cfg.local_link, "local_link")
    _check_codec_engines(cfg)
    _check_layouts(cfg)
    _check_vllm_memory(cfg)
    _check_tenants(cfg)
    _check_identity(cfg)
    if cfg.router.site is not None and cfg.router.site not in sites:
        raise ConfigError(f"router.site: unknown site {cfg.router.site!r} (sites: {', '.join(sorted(sites))})")
    _check_routers(cfg, sites)
    _check_loopback(cfg)


def _check_routers(cfg: ClusterConfig, sites: set[str]) -> None:
    """Router names are unique, at known sites, and name their identities themselves."""
    seen: set[str] = set()
    for i, r in enumerate(cfg.routers):
        if r.name in seen:
            raise ConfigError(f"routers[{i}].name: duplicate router {r.name!r}")
        seen.add(r.name)
        if r.site not in sites:
            raise ConfigError(f"routers[{i}].site: unknown site {r.site!r} (sites: {', '.join(sorted(sites))})")
    if not cfg.routers and cfg.etcd != EtcdSection():
        raise ConfigError("etcd: set, but routers: lists no routers: one router shares nothing through etcd "
                          "(list the routers, or remove etcd:)")
    if not cfg.routers and cfg.postgres != PostgresSection():
        raise ConfigError("postgres: set, but routers: lists no routers: one router keeps its jobs in "
                          "router.records.jobs_db (list the routers, or remove postgres:)")
    if cfg.routers and cfg.tls.router_identity is not None:
        raise ConfigError("tls.router_identity: with routers: listed, each router's identity is "
                          "kvrelay://<its site>/router/<its name>; remove tls.router_identity")


def _check_loopback(cfg: ClusterConfig) -> None:
    """Plaintext and anonymous access are for one machine only."""
    hosts = [("router.host", cfg.router.host), ("workers.host", cfg.workers.host),
             *((f"routers[{i}].host", r.host) for i, r in enumerate(cfg.routers))]
    exposed = [f"{n} {h}" for n, h in hosts if not is_loopback(h)]
    if exposed and not cfg.tls.enabled:
        raise ConfigError(f"tls.enabled: false is refused because {exposed[0]} is not a loopback address")
    if exposed and cfg.auth.allow_anonymous:
        raise ConfigError(f"auth.allow_anonymous: true is refused because {exposed[0]} is not a loopback address")


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
        _check_codec(link, where)
        if len(link.between) != 2 or link.between[0] == link.between[1]:
            raise ConfigError(f"{where}.between: must name two different sites, got {link.between}")
        for name in link.between:
            if name not in sites:
                raise ConfigError(f"{where}.between: unknown site {name!r} (sites: {', '.join(sorted(sites))})")
        pair = frozenset(link.between)
        if pair in pairs:
            raise ConfigError(f"{where}: duplicate link between {link.between[0]} and {link.between[1]}")
        pairs.add(pair)


def _check_codec(link: LinkSection, where: str) -> None:
    """A codec carries bytes: not on a link that pins a transport that pulls."""
    if link.kv_codec != KVCodec.NONE and link.transport in (Transport.NIXL, Transport.LOCAL):
        raise ConfigError(f"{where}.kv_codec: {link.kv_codec} sends bytes over tcp; the link pins transport "
                          f"{link.transport}, which pulls the cache's own bytes (set transport: tcp, or kv_codec: "
                          "none)")


def _check_codec_engines(cfg: ClusterConfig) -> None:
    """A lossy codec decodes into this engine's K and V planes: a vLLM pool at either end of its link refuses it."""
    by_name = {s.name: s for s in cfg.sites}
    named = [("local_link", cfg.local_link, list(by_name))] + \
        [(f"links[{i}]", lk, list(lk.between)) for i, lk in enumerate(cfg.links)]
    for where, link, ends in named:
        if link.kv_codec == KVCodec.NONE:
            continue
        for name in ends:
            site = by_name[name]
            if any(site.pool(r).engine is EngineKind.VLLM and site.pool(r).replicas > 0 for r in Role):
                raise ConfigError(f"{where}.kv_codec: {link.kv_codec} decodes into the builtin engine's cache; "
                                  f"site {name} has a vLLM pool, whose KV pages a codec cannot read")


def _kv_kind(cfg: ClusterConfig, pool: PoolSection) -> tuple[str, str, int | None]:
    """What the config fixes of a pool's KV layout: its engine, dtype and block size (None: vLLM's default)."""
    if pool.engine is EngineKind.VLLM:
        v = pool.vllm or VllmSection()
        return EngineKind.VLLM.value, v.dtype or cfg.model.dtype, v.block_size
    return EngineKind.BUILTIN.value, cfg.model.dtype, cfg.cache.block_size


def _same_kind(a: tuple[str, str, int | None], b: tuple[str, str, int | None]) -> bool:
    return a[:2] == b[:2] and (a[2] is None or b[2] is None or a[2] == b[2])


def _check_layouts(cfg: ClusterConfig) -> None:
    """A decode pool whose site has no prefill pool gets its prompts' KV only over links: a prefill pool they
    reach must share its KV layout (placement never pairs layouts that differ), or no prompt would move."""
    by_name = {s.name: s for s in cfg.sites}
    linked: dict[str, list[str]] = {s.name: [] for s in cfg.sites}
    for link in cfg.links:
        linked[link.between[0]].append(link.between[1])
        linked[link.between[1]].append(link.between[0])
    for i, site in enumerate(cfg.sites):
        if site.decode.replicas == 0 or site.prefill.replicas > 0:
            continue
        want = _kv_kind(cfg, site.decode)
        sources = [by_name[n] for n in sorted(linked[site.name]) if by_name[n].prefill.replicas > 0]
        if sources and not any(_same_kind(want, _kv_kind(cfg, s.prefill)) for s in sources):
            reached = ", ".join(f"{s.name} ({'/'.join(str(x) for x in _kv_kind(cfg, s.prefill))})" for s in sources)
            raise ConfigError(f"sites[{i}].decode.engine: {'/'.join(str(x) for x in want)} KV, but the site has no "
                              f"prefill pool and its links reach only prefill pools of another KV layout: "
                              f"{reached}; the link would never carry a prompt (match engine, dtype and block "
                              "size, or give the site a prefill pool)")


def _check_vllm_memory(cfg: ClusterConfig) -> None:
    """gpu_memory_utilization sizes a GPU pool's KV only, and only without kv_cache_memory_gib: refused where
    vLLM would ignore it."""
    for i, site in enumerate(cfg.sites):
        for role in Role:
            pool = site.pool(role)
            v = pool.vllm
            if v is None or v.gpu_memory_utilization is None:
                continue
            where = f"sites[{i}].{role}.vllm.gpu_memory_utilization"
            if (pool.device or cfg.model.device) == "cpu":
                raise ConfigError(f"{where}: applies to GPU pools; a vLLM pool on cpu sizes its KV by "
                                  "kv_cache_memory_gib (default: cache.memory_gib)")
            if v.kv_cache_memory_gib is not None:
                raise ConfigError(f"{where}: not with kv_cache_memory_gib (vLLM sizes the KV by that one)")


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


_ADAPTER = TypeAdapter(ClusterConfig)


def _check_identity(cfg: ClusterConfig) -> None:
    """Providers have unique names and issuers; their rules name known tenants."""
    names = {t.name for t in cfg.tenants}
    seen: set[str] = set()
    for i, p in enumerate(cfg.identity.oidc):
        if p.name in seen or p.issuer in seen:
            raise ConfigError(f"identity.oidc[{i}]: name {p.name!r} or issuer {p.issuer!r} given twice")
        seen |= {p.name, p.issuer}
        for j, rule in enumerate(p.rules):
            if rule.tenant is not None and rule.tenant not in names:
                raise ConfigError(f"identity.oidc[{i}].rules[{j}].tenant: {rule.tenant!r} is not a tenant "
                                  f"(tenants: {', '.join(sorted(names)) or 'none'})")


def _check_unicode(raw: Any) -> None:
    """Refuses, naming where, a key or string that is not Unicode text (a lone surrogate, which YAML's
    ``"\\ud800"`` escape makes and no file, log or peer can carry); pydantic would fail on it unnamed."""
    stack: list[tuple[Any, tuple]] = [(raw, ())]
    seen: set[int] = set()  # YAML's anchors make shared and self-containing nodes: each is read once
    while stack:
        value, loc = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and not _encodes(key):
                raise ConfigError(f"{_where(loc) if loc else 'config'}: a key that is not Unicode text "
                                  f"(a lone surrogate): {key!a}")
            if isinstance(item, str) and not _encodes(item):
                raise ConfigError(f"{_where((*loc, key))}: not Unicode text (a lone surrogate): {ascii(item)[:80]}")
            stack.append((item, (*loc, key)))
    if isinstance(raw, str) and not _encodes(raw):
        raise ConfigError(f"config: not Unicode text (a lone surrogate): {ascii(raw)[:80]}")


def _encodes(text: str) -> bool:
    """Whether ``text`` is encodable as UTF-8 (has no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_config(raw: Any) -> ClusterConfig:
    """The config in ``raw`` (YAML's data: mappings, lists, scalars), validated;
    a ConfigError names the first field at fault."""
    _check_unicode(raw)
    try:
        cfg = _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise ConfigError(_message(exc.errors(include_url=False)[0])) from None
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
