from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHello(_message.Message):
    __slots__ = ("protocol_version", "layout_hash", "nonce", "key_share", "certificate", "ciphers", "protection", "socket_buffer_bytes", "sent_unix_ms", "stamp", "codec")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    CIPHERS_FIELD_NUMBER: _ClassVar[int]
    PROTECTION_FIELD_NUMBER: _ClassVar[int]
    SOCKET_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STAMP_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    layout_hash: str
    nonce: bytes
    key_share: bytes
    certificate: bytes
    ciphers: _containers.RepeatedScalarFieldContainer[str]
    protection: str
    socket_buffer_bytes: int
    sent_unix_ms: int
    stamp: bytes
    codec: str
    def __init__(self, protocol_version: _Optional[int] = ..., layout_hash: _Optional[str] = ..., nonce: _Optional[bytes] = ..., key_share: _Optional[bytes] = ..., certificate: _Optional[bytes] = ..., ciphers: _Optional[_Iterable[str]] = ..., protection: _Optional[str] = ..., socket_buffer_bytes: _Optional[int] = ..., sent_unix_ms: _Optional[int] = ..., stamp: _Optional[bytes] = ..., codec: _Optional[str] = ...) -> None: ...

class KVHelloAnswer(_message.Message):
    __slots__ = ("accepted", "reason", "nonce", "key_share", "certificate", "cipher", "protection")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    CIPHER_FIELD_NUMBER: _ClassVar[int]
    PROTECTION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    nonce: bytes
    key_share: bytes
    certificate: bytes
    cipher: str
    protection: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., nonce: _Optional[bytes] = ..., key_share: _Optional[bytes] = ..., certificate: _Optional[bytes] = ..., cipher: _Optional[str] = ..., protection: _Optional[str] = ...) -> None: ...

class KVHelloAck(_message.Message):
    __slots__ = ("answer", "signature", "proof")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    answer: bytes
    signature: bytes
    proof: bytes
    def __init__(self, answer: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class KVAuth(_message.Message):
    __slots__ = ("signature", "proof")
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    signature: bytes
    proof: bytes
    def __init__(self, signature: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class KVOffer(_message.Message):
    __slots__ = ("host_id", "shm_path", "num_blocks", "nixl_metadata", "kv_base_address", "kv_device_id")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    shm_path: str
    num_blocks: int
    nixl_metadata: bytes
    kv_base_address: int
    kv_device_id: int
    def __init__(self, host_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., num_blocks: _Optional[int] = ..., nixl_metadata: _Optional[bytes] = ..., kv_base_address: _Optional[int] = ..., kv_device_id: _Optional[int] = ...) -> None: ...

class KVAuthAck(_message.Message):
    __slots__ = ("accepted", "reason", "shared_memory")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    shared_memory: bool
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., shared_memory: _Optional[bool] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("transfer_id", "layer", "num_layers", "first", "count", "payload_bytes", "src_blocks", "pulled_tags", "codec")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TAGS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    num_layers: int
    first: int
    count: int
    payload_bytes: int
    src_blocks: _containers.RepeatedScalarFieldContainer[int]
    pulled_tags: bytes
    codec: str
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., src_blocks: _Optional[_Iterable[int]] = ..., pulled_tags: _Optional[bytes] = ..., codec: _Optional[str] = ...) -> None: ...

class KVDone(_message.Message):
    __slots__ = ("transfer_id", "first_token_id", "first_logprob", "traceparent")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_token_id: int
    first_logprob: float
    traceparent: str
    def __init__(self, transfer_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., traceparent: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("hello", "hello_ack", "auth", "auth_ack", "blocks", "done", "done_ack", "offer")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    AUTH_ACK_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_ACK_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    hello: KVHello
    hello_ack: KVHelloAck
    auth: KVAuth
    auth_ack: KVAuthAck
    blocks: KVBlocks
    done: KVDone
    done_ack: KVDoneAck
    offer: KVOffer
    def __init__(self, hello: _Optional[_Union[KVHello, _Mapping]] = ..., hello_ack: _Optional[_Union[KVHelloAck, _Mapping]] = ..., auth: _Optional[_Union[KVAuth, _Mapping]] = ..., auth_ack: _Optional[_Union[KVAuthAck, _Mapping]] = ..., blocks: _Optional[_Union[KVBlocks, _Mapping]] = ..., done: _Optional[_Union[KVDone, _Mapping]] = ..., done_ack: _Optional[_Union[KVDoneAck, _Mapping]] = ..., offer: _Optional[_Union[KVOffer, _Mapping]] = ...) -> None: ...
