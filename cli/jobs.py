"""`kvrelay job` commands: submit a JSONL file of requests, follow a job,
fetch its results, list, cancel and delete jobs.

One request per line, as a JSON object with the fields of
``kvrelay.v1.GenerateRequest``; shortcuts: ``"token_ids": [..]`` for a
tokenized prompt, ``"messages": [{"role": .., "content": ..}]`` for a chat,
and the sampling fields (``temperature``, ``top_p``, ``top_k``, ``seed``, the
penalties, ``min_p``, ``min_tokens``: :data:`SAMPLING_FIELDS`) at the top level::

    {"prompt": "What is an NREN?", "max_tokens": 64}
    {"messages": [{"role": "user", "content": "Hello"}], "temperature": 0.7, "seed": 1}
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import descriptor, json_format

from kvrelay.cli.common import add_connect_flags, client_dialer, grpc_error, routers_for, table
from kvrelay.router.core.job_limits import (
    MAX_JOB_BYTES,
    MAX_JOB_REQUESTS,
    MAX_REQUEST_BYTES,
    job_limit_error,
)
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "logprobs", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "min_p", "min_tokens")
SHORTCUTS = ("token_ids", "messages", *SAMPLING_FIELDS)
"""Fields a line may have besides GenerateRequest's own (see the module's docstring)."""
REQUEST_FIELDS = frozenset(f.name for f in ipb.GenerateRequest.DESCRIPTOR.fields) | frozenset(
    f.json_name for f in ipb.GenerateRequest.DESCRIPTOR.fields)
MAX_INT_DIGITS = 20
"""Longest integer literal a line may hold (every integer field fits in 20 digits)."""
MAX_REASON_CHARS = 300
"""A reason quoting the line (protobuf's do) is cut to this many characters."""
STATES = {0: "?", 1: "queued", 2: "running", 3: "done", 4: "cancelled"}
_REQUEST_INDEX = re.compile(r"requests\[(\d+)\]: ")


class JobFileError(ValueError):
    """A line of the job file is not a valid request; the message names it."""


class _LineError(ValueError):
    """What is wrong with one line (the caller adds the file and line number)."""


@dataclass(slots=True)
class JobFile:
    """A parsed job file: its requests, and the line each came from."""

    path: Path
    name: str
    """The job's name (default: the file's)."""
    requests: list[ipb.GenerateRequest]
    lines: list[int]

    def where(self, message: str) -> str:
        """``message``, led by ``path:line:`` when it names a request (``requests[i]: ...``)."""
        m = _REQUEST_INDEX.match(message)
        if m is None or int(m.group(1)) >= len(self.lines):
            return f"{self.path}: {message}"
        return f"{self.path}:{self.lines[int(m.group(1))]}: {message}"


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    """The file's bytes; JobFileError if it cannot be read or holds more than ``max_bytes``."""
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
            size = path.stat().st_size if path.is_file() else None
    except OSError as exc:
        raise JobFileError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise JobFileError(f"{path}: job file is {size or f'over {max_bytes}'} bytes; "
                           f"at most {max_bytes} ({max_bytes >> 20} MiB)")
    return data


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's fields; refuses one given twice (JSON would keep the last silently)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _LineError(f"field {k!r} appears twice")
        out[k] = v
    return out


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent; refused if no float holds it (1e999)."""
    x = float(text)
    if not math.isfinite(x):
        raise _LineError(f"number {text[:30]} is out of range")
    return x


def _short_int(text: str) -> int:
    """A JSON integer; refused past MAX_INT_DIGITS (before int() is asked to read 100,000 digits)."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _LineError(f"integer with {len(text.lstrip('-'))} digits; at most {MAX_INT_DIGITS}")
    return int(text)


def _no_constant(name: str) -> float:
    """NaN, Infinity, -Infinity (which Python's json accepts, and JSON does not)."""
    raise _LineError(f"{name} is not a number a request can hold")


def _json_type(value: object) -> str:
    """``value``'s kind as JSON names it."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kinds: dict[type, str] = {dict: "an object", list: "an array", str: "a string"}
    return kinds.get(type(value), "a number")


def _clip(text: str) -> str:
    """``text`` cut in the middle to MAX_REASON_CHARS (protobuf names the field at the end)."""
    half = MAX_REASON_CHARS // 2
    return text if len(text) <= MAX_REASON_CHARS else f"{text[:half]}...{text[-half:]}"


def _decode(raw: bytes, max_line_bytes: int) -> dict:
    """One line as a JSON object, with every way JSON can be bad turned into _LineError."""
    if len(raw) > max_line_bytes:
        raise _LineError(f"line is {len(raw)} bytes; at most {max_line_bytes} ({max_line_bytes >> 20} MiB)")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_float=_finite,
                         parse_int=_short_int, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise _LineError(f"not UTF-8 (byte {exc.start + 1} of the line)") from None
    except json.JSONDecodeError as exc:
        raise _LineError(f"not JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise _LineError("not JSON a request can hold: nested too deeply") from None
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {_json_type(obj)}")
    return obj


def _expand(obj: dict) -> dict:
    """The line with its shortcuts spelled out as GenerateRequest's JSON; unknown fields refused by name."""
    unknown = [k for k in obj if k not in REQUEST_FIELDS and k not in SHORTCUTS]
    if unknown:
        raise _LineError(f"unknown field {unknown[0]!r} (a line holds GenerateRequest's fields, "
                         f"or {', '.join(SHORTCUTS)})")
    if isinstance(obj.get("token_ids"), list):
        obj["token_ids"] = {"ids": obj["token_ids"]}
    if isinstance(obj.get("messages"), list):
        obj["messages"] = {"messages": obj["messages"]}
    sampling = {k: obj.pop(k) for k in SAMPLING_FIELDS if k in obj}
    if sampling:
        inner = obj.setdefault("sampling", {})
        if not isinstance(inner, dict):
            raise _LineError(f"sampling must be an object, got {_json_type(inner)}")
        both = sorted(set(sampling) & set(inner))
        if both:
            raise _LineError(f"field {both[0]!r} is given both at the top level and in sampling")
        inner.update(sampling)
    return obj


def _check(req: ipb.GenerateRequest) -> None:
    """What the JSON could not say is refused: max_tokens 0, a non-finite sampling number."""
    if req.HasField("max_tokens") and req.max_tokens < 1:  # the router's rule and message
        raise _LineError(f"max_tokens must be >= 1, got {req.max_tokens}")
    for f in req.sampling.DESCRIPTOR.fields:
        if f.type in (descriptor.FieldDescriptor.TYPE_FLOAT, descriptor.FieldDescriptor.TYPE_DOUBLE) \
                and not math.isfinite(getattr(req.sampling, f.name)):
            raise _LineError(f"sampling.{f.name} must be a finite number")


def parse_line(raw: bytes, max_line_bytes: int = MAX_REQUEST_BYTES) -> ipb.GenerateRequest:
    """One line of a job file as a request; _LineError (naming the field) if it is not one."""
    obj = _expand(_decode(raw, max_line_bytes))
    try:
        req = json_format.ParseDict(obj, ipb.GenerateRequest())
    except json_format.ParseError as exc:
        raise _LineError(_clip(str(exc).split("\n")[0])) from None
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. a lone surrogate (UnicodeEncodeError)
        raise _LineError(_clip(f"not a request: {type(exc).__name__}: {exc}")) from None
    _check(req)
    return req


def parse_job_file(path: Path, name: str | None = None, max_bytes: int = MAX_JOB_BYTES,
                   max_line_bytes: int = MAX_REQUEST_BYTES, max_requests: int = MAX_JOB_REQUESTS) -> JobFile:
    """The requests of a JSONL job file, within the router's limits (the same
    messages); JobFileError naming the file and line (``job.jsonl:17: ...``)."""
    lines = _read_bounded(path, max_bytes).split(b"\n")  # not str.splitlines: JSON strings may hold U+2028
    count = sum(1 for line in lines if line.strip())
    if count > max_requests:
        raise JobFileError(f"{path}: job has {count} requests; at most {max_requests}")
    job = JobFile(path, name or path.name, [], [])
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            job.requests.append(parse_line(raw.removesuffix(b"\r"), max_line_bytes))
        except _LineError as exc:
            raise JobFileError(f"{path}:{n}: {exc}") from None
        job.lines.append(n)
    if not job.requests:
        raise JobFileError(f"{path}: no requests in the file")
    problem = job_limit_error(job.name, job.requests)  # the router's own check, before sending
    if problem is not None:
        raise JobFileError(job.where(problem))
    return job


def _stub(args):
    """A channel to the router (sending up to a job's size) and a Jobs stub on it."""
    dialer = client_dialer(args)  # several routers: the first that reads this tenant's prompts (jobs are shared)
    ch = dialer.sync(routers_for(args, dialer)[0], max_send_bytes=256 << 20)
    return ch, jgrpc.JobsStub(ch)


def _job_rows(jobs) -> list[tuple[str, ...]]:
    def when(t: float) -> str:
        return datetime.datetime.fromtimestamp(t).isoformat(timespec="seconds") if t else "-"
    return [("JOB", "NAME", "STATE", "DONE", "FAILED", "TOTAL", "CREATED", "FINISHED")] + [
        (j.id, j.name or "-", STATES.get(j.state, "?"), str(j.completed), str(j.failed), str(j.total),
         when(j.created_unix), when(j.finished_unix)) for j in jobs]


def _call(args: argparse.Namespace, method: str, request, timeout_s: float = 30.0):
    """Jobs.``method``; the response, or None after printing the error."""

    dialer = client_dialer(args)
    addresses = routers_for(args, dialer)
    for i, address in enumerate(addresses):
        with dialer.sync(address) as ch:
            try:
                return getattr(jgrpc.JobsStub(ch), method)(request, timeout=timeout_s)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or i == len(addresses) - 1:
                    grpc_error(exc)
                    return None
                print(f"kvrelay: router {address} is unavailable; asking {addresses[i + 1]}", file=sys.stderr)
    return None


def cmd_job_submit(args: argparse.Namespace) -> int:
    """Checks the file, sends it as one job; prints the job's id."""
    try:
        job = parse_job_file(Path(args.file), args.name)
    except JobFileError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    ch, stub = _stub(args)
    with ch:
        try:
            resp = stub.SubmitJob(jpb.SubmitJobRequest(name=job.name, requests=job.requests), timeout=120.0)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                return grpc_error(exc)
            print(f"kvrelay: {job.where(exc.details() or '')}", file=sys.stderr)  # the line of the bad request
            return 1
    print(resp.id)
    print(f"kvrelay: job {resp.id}: {resp.total} requests queued (kvrelay job status {resp.id}; "
          f"kvrelay job results {resp.id})", file=sys.stderr)
    return 0


def cmd_job_status(args: argparse.Namespace) -> int:

    if args.id:
        job = _call(args, "GetJob", jpb.GetJobRequest(id=args.id))
        jobs = None if job is None else [job]
    else:
        resp = _call(args, "ListJobs", jpb.ListJobsRequest())
        jobs = None if resp is None else resp.jobs
    if jobs is None:
        return 1
    table(_job_rows(jobs))
    return 0


def cmd_job_cancel(args: argparse.Namespace) -> int:

    job = _call(args, "CancelJob", jpb.CancelJobRequest(id=args.id))
    if job is None:
        return 1
    table(_job_rows([job]))
    return 0


def cmd_job_delete(args: argparse.Namespace) -> int:
    """Deletes a job with its requests and results (the router cancels it first if it runs)."""
    resp = _call(args, "DeleteJob", jpb.DeleteJobRequest(id=args.id))
    if resp is None:
        return 1
    print(f"deleted job {resp.id}: {resp.requests_deleted} requests and their results")
    return 0


def cmd_job_results(args: argparse.Namespace) -> int:
    """Writes one JSON line per result (index, request_id, text, token_ids, finish, error)."""
    dialer = client_dialer(args)
    addresses = routers_for(args, dialer)
    written: set[int] = set()
    """Indexes written: following again at another router (the first went away) writes none twice."""
    with open(args.out, "w") if args.out else contextlib.nullcontext(sys.stdout) as out:
        for i, address in enumerate(addresses):
            with dialer.sync(address) as ch:
                try:
                    for r in jgrpc.JobsStub(ch).JobResults(jpb.JobResultsRequest(id=args.id, follow=args.follow),
                                                           timeout=args.timeout):
                        if r.index not in written:
                            written.add(r.index)
                            out.write(json.dumps(json_format.MessageToDict(
                                r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)) + "\n")
                            out.flush()
                    return 0
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or i == len(addresses) - 1:
                        return grpc_error(exc)
                    print(f"kvrelay: router {address} went away after {len(written)} results; following the job "
                          f"at {addresses[i + 1]}", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    job = sub.add_parser("job", help="batch jobs: submit a JSONL file, follow it, fetch results").add_subparsers(
        dest="job_command", required=True)
    js = job.add_parser("submit", help="submit a JSONL file of requests; prints the job id")
    js.add_argument("file")
    js.add_argument("--name", help="job name (default: the file's name)")
    js.set_defaults(func=cmd_job_submit)
    jt = job.add_parser("status", help="a job's progress (without ID: every job)")
    jt.add_argument("id", nargs="?")
    jt.set_defaults(func=cmd_job_status)
    jc = job.add_parser("cancel", help="stop a job (finished results stay)")
    jc.add_argument("id")
    jc.set_defaults(func=cmd_job_cancel)
    jd = job.add_parser("delete", help="delete a job, its requests and its results (cancelling it first if it runs)")
    jd.add_argument("id")
    jd.set_defaults(func=cmd_job_delete)
    jr = job.add_parser("results", help="a job's results as JSON lines")
    jr.add_argument("id")
    jr.add_argument("--follow", action="store_true", help="wait for the rest until the job finishes")
    jr.add_argument("--out", help="write to this file instead of stdout")
    jr.add_argument("--timeout", type=float, default=86400.0, help="give up after this many seconds")
    jr.set_defaults(func=cmd_job_results)
    for p in (js, jt, jc, jd, jr):
        add_connect_flags(p)
