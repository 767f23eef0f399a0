from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class RouterPeer(_message.Message):
    __slots__ = ("name", "site", "address", "internal_address", "http_address", "jurisdiction")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    JURISDICTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    site: str
    address: str
    internal_address: str
    http_address: str
    jurisdiction: str
    def __init__(self, name: _Optional[str] = ..., site: _Optional[str] = ..., address: _Optional[str] = ..., internal_address: _Optional[str] = ..., http_address: _Optional[str] = ..., jurisdiction: _Optional[str] = ...) -> None: ...

class ListRoutersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRoutersResponse(_message.Message):
    __slots__ = ("routers", "answered_by", "yours")
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    YOURS_FIELD_NUMBER: _ClassVar[int]
    routers: _containers.RepeatedCompositeFieldContainer[RouterPeer]
    answered_by: str
    yours: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, routers: _Optional[_Iterable[_Union[RouterPeer, _Mapping]]] = ..., answered_by: _Optional[str] = ..., yours: _Optional[_Iterable[str]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: bool
    top_logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    min_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "token_ids", "sampling", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "request_id", "raw_prompt", "allowed_jurisdictions", "resume_token_ids", "resume_ticket")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_JURISDICTIONS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TICKET_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: ChatMessages
    token_ids: TokenIds
    sampling: SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    request_id: str
    raw_prompt: bool
    allowed_jurisdictions: _containers.RepeatedScalarFieldContainer[str]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_ticket: bytes
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., request_id: _Optional[str] = ..., raw_prompt: _Optional[bool] = ..., allowed_jurisdictions: _Optional[_Iterable[str]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., resume_ticket: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("prefill_worker", "decode_worker", "prefill_site", "decode_site", "colocated", "transport", "kv_bytes", "ttft_ms", "estimated_ttft_ms", "policy", "prefill_cached_blocks", "decode_cached_blocks", "link", "kv_transfer_ms", "prefill_ms", "retries", "migrations", "trace_id", "kv_codec", "link_gbps", "link_rate_source", "link_measured_gbps", "link_bound")
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SITE_FIELD_NUMBER: _ClassVar[int]
    DECODE_SITE_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CODEC_FIELD_NUMBER: _ClassVar[int]
    LINK_GBPS_FIELD_NUMBER: _ClassVar[int]
    LINK_RATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    LINK_MEASURED_GBPS_FIELD_NUMBER: _ClassVar[int]
    LINK_BOUND_FIELD_NUMBER: _ClassVar[int]
    prefill_worker: str
    decode_worker: str
    prefill_site: str
    decode_site: str
    colocated: bool
    transport: str
    kv_bytes: int
    ttft_ms: float
    estimated_ttft_ms: float
    policy: str
    prefill_cached_blocks: int
    decode_cached_blocks: int
    link: str
    kv_transfer_ms: float
    prefill_ms: float
    retries: int
    migrations: int
    trace_id: str
    kv_codec: str
    link_gbps: float
    link_rate_source: str
    link_measured_gbps: float
    link_bound: bool
    def __init__(self, prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., prefill_site: _Optional[str] = ..., decode_site: _Optional[str] = ..., colocated: _Optional[bool] = ..., transport: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., estimated_ttft_ms: _Optional[float] = ..., policy: _Optional[str] = ..., prefill_cached_blocks: _Optional[int] = ..., decode_cached_blocks: _Optional[int] = ..., link: _Optional[str] = ..., kv_transfer_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., retries: _Optional[int] = ..., migrations: _Optional[int] = ..., trace_id: _Optional[str] = ..., kv_codec: _Optional[str] = ..., link_gbps: _Optional[float] = ..., link_rate_source: _Optional[str] = ..., link_measured_gbps: _Optional[float] = ..., link_bound: _Optional[bool] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "usage", "placement")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    placement: Placement
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish", "top_logprobs", "resume_ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish: Finish
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    resume_ticket: bytes
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., resume_ticket: _Optional[bytes] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "context_window", "chat")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    name: str
    context_window: int
    chat: bool
    def __init__(self, name: _Optional[str] = ..., context_window: _Optional[int] = ..., chat: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "prefill_workers", "decode_workers")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    prefill_workers: int
    decode_workers: int
    def __init__(self, serving: _Optional[bool] = ..., prefill_workers: _Optional[int] = ..., decode_workers: _Optional[int] = ...) -> None: ...
