from kvrelay.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_DONE: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_DONE: JobState
JOB_STATE_CANCELLED: JobState

class Job(_message.Message):
    __slots__ = ("id", "name", "state", "total", "completed", "failed", "created_unix", "finished_unix")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: JobState
    total: int
    completed: int
    failed: int
    created_unix: float
    finished_unix: float
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., created_unix: _Optional[float] = ..., finished_unix: _Optional[float] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("name", "requests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    requests: _containers.RepeatedCompositeFieldContainer[_inference_pb2.GenerateRequest]
    def __init__(self, name: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[_inference_pb2.GenerateRequest, _Mapping]]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("id", "requests_deleted")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    id: str
    requests_deleted: int
    def __init__(self, id: _Optional[str] = ..., requests_deleted: _Optional[int] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("index", "request_id", "token_ids", "text", "finish", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish: _inference_pb2.Finish
    error: str
    def __init__(self, index: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish: _Optional[_Union[_inference_pb2.Finish, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class JobResultsRequest(_message.Message):
    __slots__ = ("id", "from_index", "follow")
    ID_FIELD_NUMBER: _ClassVar[int]
    FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    id: str
    from_index: int
    follow: bool
    def __init__(self, id: _Optional[str] = ..., from_index: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...
