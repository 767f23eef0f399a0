from kvrelay.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "site", "address", "kv_endpoint", "transport", "model", "layout_hash", "block_size", "num_blocks", "num_layers", "kv_block_bytes", "device", "metrics_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    site: str
    address: str
    kv_endpoint: str
    transport: str
    model: str
    layout_hash: str
    block_size: int
    num_blocks: int
    num_layers: int
    kv_block_bytes: int
    device: str
    metrics_address: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., site: _Optional[str] = ..., address: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., transport: _Optional[str] = ..., model: _Optional[str] = ..., layout_hash: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_block_bytes: _Optional[int] = ..., device: _Optional[str] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "running", "waiting", "free_blocks", "total_blocks", "prefill_tokens_total", "decode_tokens_total", "kv_bytes_received", "kv_bytes_sent", "reservations", "prefix_hit_blocks", "prefix_query_blocks", "queued_prefill_tokens", "prefill_tokens_per_s", "decode_step_ms", "incarnation", "usage")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    prefill_tokens_total: int
    decode_tokens_total: int
    kv_bytes_received: int
    kv_bytes_sent: int
    reservations: int
    prefix_hit_blocks: int
    prefix_query_blocks: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    decode_step_ms: float
    incarnation: str
    usage: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    def __init__(self, worker_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., prefill_tokens_total: _Optional[int] = ..., decode_tokens_total: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., reservations: _Optional[int] = ..., prefix_hit_blocks: _Optional[int] = ..., prefix_query_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_ms: _Optional[float] = ..., incarnation: _Optional[str] = ..., usage: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "link", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "kv_bytes", "engine_ns")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    link: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    kv_bytes: int
    engine_ns: int
    def __init__(self, tenant: _Optional[str] = ..., link: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., engine_ns: _Optional[int] = ...) -> None: ...

class KVCacheEvents(_message.Message):
    __slots__ = ("stored", "removed", "snapshot")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    snapshot: bool
    def __init__(self, stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "routers")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    routers: _containers.RepeatedCompositeFieldContainer[_inference_pb2.RouterPeer]
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., routers: _Optional[_Iterable[_Union[_inference_pb2.RouterPeer, _Mapping]]] = ...) -> None: ...

class LinkReport(_message.Message):
    __slots__ = ("site", "reachable", "connect_ms", "error")
    SITE_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    CONNECT_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    site: str
    reachable: bool
    connect_ms: float
    error: str
    def __init__(self, site: _Optional[str] = ..., reachable: _Optional[bool] = ..., connect_ms: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ProbeTarget(_message.Message):
    __slots__ = ("site", "address")
    SITE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    site: str
    address: str
    def __init__(self, site: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("load", "kv_events", "links")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    load: WorkerLoad
    kv_events: KVCacheEvents
    links: _containers.RepeatedCompositeFieldContainer[LinkReport]
    def __init__(self, load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., kv_events: _Optional[_Union[KVCacheEvents, _Mapping]] = ..., links: _Optional[_Iterable[_Union[LinkReport, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "send_snapshot", "drain", "drained", "probes", "probe_timeout_s", "routers")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    SEND_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    PROBE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    send_snapshot: bool
    drain: bool
    drained: bool
    probes: _containers.RepeatedCompositeFieldContainer[ProbeTarget]
    probe_timeout_s: float
    routers: _containers.RepeatedCompositeFieldContainer[_inference_pb2.RouterPeer]
    def __init__(self, known: _Optional[bool] = ..., send_snapshot: _Optional[bool] = ..., drain: _Optional[bool] = ..., drained: _Optional[bool] = ..., probes: _Optional[_Iterable[_Union[ProbeTarget, _Mapping]]] = ..., probe_timeout_s: _Optional[float] = ..., routers: _Optional[_Iterable[_Union[_inference_pb2.RouterPeer, _Mapping]]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "load", "healthy", "last_heartbeat_age_s", "draining", "inflight", "cached_blocks")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    load: WorkerLoad
    healthy: bool
    last_heartbeat_age_s: float
    draining: bool
    inflight: int
    cached_blocks: int
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., healthy: _Optional[bool] = ..., last_heartbeat_age_s: _Optional[float] = ..., draining: _Optional[bool] = ..., inflight: _Optional[int] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class LinkStatus(_message.Message):
    __slots__ = ("name", "rtt_ms", "gbps", "transport", "protection", "up", "down_reason", "changed_s_ago", "kv_bytes_per_s", "kv_codec", "measured_gbps", "measured_floor_gbps", "measured_rtt_ms", "rate_samples", "measured_s_ago", "rate_source", "placement_gbps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    GBPS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PROTECTION_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    DOWN_REASON_FIELD_NUMBER: _ClassVar[int]
    CHANGED_S_AGO_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_CODEC_FIELD_NUMBER: _ClassVar[int]
    MEASURED_GBPS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FLOOR_GBPS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    RATE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_S_AGO_FIELD_NUMBER: _ClassVar[int]
    RATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_GBPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    rtt_ms: float
    gbps: float
    transport: str
    protection: str
    up: bool
    down_reason: str
    changed_s_ago: float
    kv_bytes_per_s: float
    kv_codec: str
    measured_gbps: float
    measured_floor_gbps: float
    measured_rtt_ms: float
    rate_samples: int
    measured_s_ago: float
    rate_source: str
    placement_gbps: float
    def __init__(self, name: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., gbps: _Optional[float] = ..., transport: _Optional[str] = ..., protection: _Optional[str] = ..., up: _Optional[bool] = ..., down_reason: _Optional[str] = ..., changed_s_ago: _Optional[float] = ..., kv_bytes_per_s: _Optional[float] = ..., kv_codec: _Optional[str] = ..., measured_gbps: _Optional[float] = ..., measured_floor_gbps: _Optional[float] = ..., measured_rtt_ms: _Optional[float] = ..., rate_samples: _Optional[int] = ..., measured_s_ago: _Optional[float] = ..., rate_source: _Optional[str] = ..., placement_gbps: _Optional[float] = ...) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("window_s", "requests", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_MS_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    def __init__(self, window_s: _Optional[float] = ..., requests: _Optional[int] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p90_ms: _Optional[float] = ..., itl_p50_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "links", "policy", "latency", "router_metrics_address", "storage", "routers", "router_name", "coordination")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    ROUTER_METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_NAME_FIELD_NUMBER: _ClassVar[int]
    COORDINATION_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    links: _containers.RepeatedCompositeFieldContainer[LinkStatus]
    policy: str
    latency: LatencySummary
    router_metrics_address: str
    storage: str
    routers: _containers.RepeatedCompositeFieldContainer[_inference_pb2.RouterPeer]
    router_name: str
    coordination: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkStatus, _Mapping]]] = ..., policy: _Optional[str] = ..., latency: _Optional[_Union[LatencySummary, _Mapping]] = ..., router_metrics_address: _Optional[str] = ..., storage: _Optional[str] = ..., routers: _Optional[_Iterable[_Union[_inference_pb2.RouterPeer, _Mapping]]] = ..., router_name: _Optional[str] = ..., coordination: _Optional[str] = ...) -> None: ...

class WorkRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "salt", "tenant", "batch", "prior_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    salt: str
    tenant: str
    batch: bool
    prior_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., salt: _Optional[str] = ..., tenant: _Optional[str] = ..., batch: _Optional[bool] = ..., prior_output_tokens: _Optional[int] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("endpoint", "transfer_id", "start_block", "block_ids", "layout_hash", "transport", "link_rtt_ms", "link_gbps", "protection", "receiver", "kv_codec")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LINK_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    LINK_GBPS_FIELD_NUMBER: _ClassVar[int]
    PROTECTION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    KV_CODEC_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    transfer_id: str
    start_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout_hash: str
    transport: str
    link_rtt_ms: float
    link_gbps: float
    protection: str
    receiver: str
    kv_codec: str
    def __init__(self, endpoint: _Optional[str] = ..., transfer_id: _Optional[str] = ..., start_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., layout_hash: _Optional[str] = ..., transport: _Optional[str] = ..., link_rtt_ms: _Optional[float] = ..., link_gbps: _Optional[float] = ..., protection: _Optional[str] = ..., receiver: _Optional[str] = ..., kv_codec: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "colocated", "lease_s", "link", "sender")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    request: WorkRequest
    colocated: bool
    lease_s: float
    link: str
    sender: str
    def __init__(self, request: _Optional[_Union[WorkRequest, _Mapping]] = ..., colocated: _Optional[bool] = ..., lease_s: _Optional[float] = ..., link: _Optional[str] = ..., sender: _Optional[str] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("reservation", "output")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    reservation: KVTarget
    output: _inference_pb2.GenerateResponse
    def __init__(self, reservation: _Optional[_Union[KVTarget, _Mapping]] = ..., output: _Optional[_Union[_inference_pb2.GenerateResponse, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "target")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request: WorkRequest
    target: KVTarget
    def __init__(self, request: _Optional[_Union[WorkRequest, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "kv_bytes", "prefill_ms", "transfer_ms", "cached_tokens", "first_top_logprobs", "wire_ms", "link_bound", "rtt_ms", "busy_ms")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WIRE_MS_FIELD_NUMBER: _ClassVar[int]
    LINK_BOUND_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: float
    kv_bytes: int
    prefill_ms: float
    transfer_ms: float
    cached_tokens: int
    first_top_logprobs: _inference_pb2.TopLogprobs
    wire_ms: float
    link_bound: bool
    rtt_ms: float
    busy_ms: float
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., first_top_logprobs: _Optional[_Union[_inference_pb2.TopLogprobs, _Mapping]] = ..., wire_ms: _Optional[float] = ..., link_bound: _Optional[bool] = ..., rtt_ms: _Optional[float] = ..., busy_ms: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
