"""How large a batch job may be: checked by the router before it stores a job,
and by `kvrelay job submit` before it sends one (so the client needs no more
of the router than this)."""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.v1 import inference_pb2 as ipb

MAX_JOB_REQUESTS = 100_000
"""Most requests in one job (non-blank lines of a job file)."""
MAX_JOB_BYTES = 15 << 20
"""Most bytes of a job: its requests serialized (at the CLI, also the job
file), under the public listener's default message limit (router.api.max_message_bytes, 16 MiB)."""
MAX_REQUEST_BYTES = 1 << 20
"""Most bytes of one request of a job, serialized (at the CLI, also one line of the file)."""
MAX_JOB_NAME_CHARS = 256


def job_limit_error(name: str, requests: Sequence[ipb.GenerateRequest]) -> str | None:
    """Why a job is over a limit (None: it is not); a message about one request
    starts ``requests[i]: ``. The router refuses such a job, and the CLI before sending it."""
    if len(requests) > MAX_JOB_REQUESTS:
        return f"job has {len(requests)} requests; at most {MAX_JOB_REQUESTS}"
    if len(name) > MAX_JOB_NAME_CHARS:
        return f"job name has {len(name)} characters; at most {MAX_JOB_NAME_CHARS}"
    total = 0
    for i, r in enumerate(requests):
        size = r.ByteSize()
        if size > MAX_REQUEST_BYTES:
            return (f"requests[{i}]: {size} bytes; at most {MAX_REQUEST_BYTES} ({MAX_REQUEST_BYTES >> 20} MiB) "
                    "per request")
        total += size
    if total > MAX_JOB_BYTES:
        return f"job is {total} bytes; at most {MAX_JOB_BYTES} ({MAX_JOB_BYTES >> 20} MiB)"
    return None
