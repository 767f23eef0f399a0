from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolStatus(_message.Message):
    __slots__ = ("site", "role", "desired", "active", "draining", "unhealthy", "workers")
    SITE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    site: str
    role: str
    desired: int
    active: int
    draining: int
    unhealthy: int
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, site: _Optional[str] = ..., role: _Optional[str] = ..., desired: _Optional[int] = ..., active: _Optional[int] = ..., draining: _Optional[int] = ..., unhealthy: _Optional[int] = ..., workers: _Optional[_Iterable[str]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("site", "role", "replicas")
    SITE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    site: str
    role: str
    replicas: int
    def __init__(self, site: _Optional[str] = ..., role: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("pool", "draining")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    pool: PoolStatus
    draining: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[_Union[PoolStatus, _Mapping]] = ..., draining: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolStatus
    def __init__(self, pool: _Optional[_Union[PoolStatus, _Mapping]] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("apply",)
    APPLY_FIELD_NUMBER: _ClassVar[int]
    apply: bool
    def __init__(self, apply: _Optional[bool] = ...) -> None: ...

class PoolPlan(_message.Message):
    __slots__ = ("site", "role", "current", "recommended", "reasons")
    SITE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    site: str
    role: str
    current: int
    recommended: int
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, site: _Optional[str] = ..., role: _Optional[str] = ..., current: _Optional[int] = ..., recommended: _Optional[int] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("plans", "window_s", "applied")
    PLANS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[PoolPlan]
    window_s: float
    applied: bool
    def __init__(self, plans: _Optional[_Iterable[_Union[PoolPlan, _Mapping]]] = ..., window_s: _Optional[float] = ..., applied: _Optional[bool] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ("since_unix", "by", "tenant")
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    since_unix: float
    by: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    def __init__(self, since_unix: _Optional[float] = ..., by: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ...) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("tenant", "site", "link", "role", "worker", "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "kv_bytes", "prefill_worker_s", "decode_worker_s")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_S_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    site: str
    link: str
    role: str
    worker: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kv_bytes: int
    prefill_worker_s: float
    decode_worker_s: float
    def __init__(self, tenant: _Optional[str] = ..., site: _Optional[str] = ..., link: _Optional[str] = ..., role: _Optional[str] = ..., worker: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., prefill_worker_s: _Optional[float] = ..., decode_worker_s: _Optional[float] = ...) -> None: ...

class UsageResponse(_message.Message):
    __slots__ = ("rows", "since_unix", "until_unix")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    UNTIL_UNIX_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[UsageRow]
    since_unix: float
    until_unix: float
    def __init__(self, rows: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ..., since_unix: _Optional[float] = ..., until_unix: _Optional[float] = ...) -> None: ...

class GovernanceRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class GovernanceResponse(_message.Message):
    __slots__ = ("statement_json",)
    STATEMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    statement_json: str
    def __init__(self, statement_json: _Optional[str] = ...) -> None: ...
