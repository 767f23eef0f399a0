from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHello(_message.Message):
    __slots__ = ("protocol_version", "layout_hash", "nonce", "host_id", "shm_path", "shm_num_blocks", "nixl_metadata", "kv_base_address", "kv_device_id", "encrypt", "socket_buffer_bytes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SHM_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ENCRYPT_FIELD_NUMBER: _ClassVar[int]
    SOCKET_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    layout_hash: str
    nonce: bytes
    host_id: str
    shm_path: str
    shm_num_blocks: int
    nixl_metadata: bytes
    kv_base_address: int
    kv_device_id: int
    encrypt: bool
    socket_buffer_bytes: int
    def __init__(self, protocol_version: _Optional[int] = ..., layout_hash: _Optional[str] = ..., nonce: _Optional[bytes] = ..., host_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., shm_num_blocks: _Optional[int] = ..., nixl_metadata: _Optional[bytes] = ..., kv_base_address: _Optional[int] = ..., kv_device_id: _Optional[int] = ..., encrypt: _Optional[bool] = ..., socket_buffer_bytes: _Optional[int] = ...) -> None: ...

class KVHelloAck(_message.Message):
    __slots__ = ("accepted", "reason", "nonce", "proof", "shared_memory")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    nonce: bytes
    proof: bytes
    shared_memory: bool
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., shared_memory: _Optional[bool] = ...) -> None: ...

class KVAuth(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...

class KVAuthAck(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("transfer_id", "layer", "num_layers", "first", "count", "payload_bytes", "crc32c", "src_blocks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    num_layers: int
    first: int
    count: int
    payload_bytes: int
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    src_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., crc32c: _Optional[_Iterable[int]] = ..., src_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class KVDone(_message.Message):
    __slots__ = ("transfer_id", "first_token_id", "first_logprob")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_token_id: int
    first_logprob: float
    def __init__(self, transfer_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ...) -> None: ...

class KVDoneAck(_message.Message):
    __slots__ = ("transfer_id", "ok", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    ok: bool
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("hello", "hello_ack", "auth", "auth_ack", "blocks", "done", "done_ack")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    AUTH_ACK_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_ACK_FIELD_NUMBER: _ClassVar[int]
    hello: KVHello
    hello_ack: KVHelloAck
    auth: KVAuth
    auth_ack: KVAuthAck
    blocks: KVBlocks
    done: KVDone
    done_ack: KVDoneAck
    def __init__(self, hello: _Optional[_Union[KVHello, _Mapping]] = ..., hello_ack: _Optional[_Union[KVHelloAck, _Mapping]] = ..., auth: _Optional[_Union[KVAuth, _Mapping]] = ..., auth_ack: _Optional[_Union[KVAuthAck, _Mapping]] = ..., blocks: _Optional[_Union[KVBlocks, _Mapping]] = ..., done: _Optional[_Union[KVDone, _Mapping]] = ..., done_ack: _Optional[_Union[KVDoneAck, _Mapping]] = ...) -> None: ...
