from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHello(_message.Message):
    __slots__ = ("protocol_version", "layout_hash", "transfer_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    layout_hash: str
    transfer_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., layout_hash: _Optional[str] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class KVHelloAck(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("layer", "kind", "first", "count", "payload_bytes", "crc32")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kind: int
    first: int
    count: int
    payload_bytes: int
    crc32: int
    def __init__(self, layer: _Optional[int] = ..., kind: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class KVDone(_message.Message):
    __slots__ = ("first_token_id", "first_logprob")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: float
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("hello", "hello_ack", "blocks", "done", "done_ack")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_ACK_FIELD_NUMBER: _ClassVar[int]
    hello: KVHello
    hello_ack: KVHelloAck
    blocks: KVBlocks
    done: KVDone
    done_ack: KVDoneAck
    def __init__(self, hello: _Optional[_Union[KVHello, _Mapping]] = ..., hello_ack: _Optional[_Union[KVHelloAck, _Mapping]] = ..., blocks: _Optional[_Union[KVBlocks, _Mapping]] = ..., done: _Optional[_Union[KVDone, _Mapping]] = ..., done_ack: _Optional[_Union[KVDoneAck, _Mapping]] = ...) -> None: ...

class KVDoneAck(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
