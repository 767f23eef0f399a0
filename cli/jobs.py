"""`kvrelay job` commands: submit a JSONL file of requests, follow a job,
fetch its results, list and cancel jobs.

One request per line, as a JSON object with the fields of
``kvrelay.v1.GenerateRequest``; shortcuts: ``"token_ids": [..]`` for a
tokenized prompt, ``"messages": [{"role": .., "content": ..}]`` for a chat,
and ``temperature``/``top_p``/``top_k``/``seed`` at the top level::

    {"prompt": "What is an NREN?", "max_tokens": 64}
    {"messages": [{"role": "user", "content": "Hello"}], "temperature": 0.7, "seed": 1}
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc

from cli.common import add_connect_flags, client_dialer, grpc_error, table

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "logprobs")
STATES = {0: "?", 1: "queued", 2: "running", 3: "done", 4: "cancelled"}


class JobFileError(ValueError):
    """A line of the job file is not a valid request; the message names it."""


def parse_job_file(path: Path) -> list:


    reqs = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise JobFileError(f"{path}: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("expected a JSON object")
            if isinstance(obj.get("token_ids"), list):
                obj["token_ids"] = {"ids": obj["token_ids"]}
            if isinstance(obj.get("messages"), list):
                obj["messages"] = {"messages": obj["messages"]}
            sampling = {k: obj.pop(k) for k in SAMPLING_FIELDS if k in obj}
            if sampling:
                obj.setdefault("sampling", {}).update(sampling)
            reqs.append(json_format.ParseDict(obj, ipb.GenerateRequest()))
        except (ValueError, json_format.ParseError) as exc:
            raise JobFileError(f"{path}:{n}: {exc}") from None
    if not reqs:
        raise JobFileError(f"{path}: no requests in the file")
    return reqs


def _stub(args):


    ch = client_dialer(args).sync(args.router, max_send_bytes=256 << 20)
    return ch, jgrpc.JobsStub(ch)


def _job_rows(jobs) -> list[tuple[str, ...]]:
    def when(t: float) -> str:
        return datetime.datetime.fromtimestamp(t).isoformat(timespec="seconds") if t else "-"
    return [("JOB", "NAME", "STATE", "DONE", "FAILED", "TOTAL", "CREATED", "FINISHED")] + [
        (j.id, j.name or "-", STATES.get(j.state, "?"), str(j.completed), str(j.failed), str(j.total),
         when(j.created_unix), when(j.finished_unix)) for j in jobs]


def _call(args: argparse.Namespace, method: str, request, timeout_s: float = 30.0):
    """Jobs.``method``; the response, or None after printing the error."""

    ch, stub = _stub(args)
    with ch:
        try:
            return getattr(stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            grpc_error(exc)
            return None


def cmd_job_submit(args: argparse.Namespace) -> int:

    try:
        reqs = parse_job_file(Path(args.file))
    except JobFileError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    job = _call(args, "SubmitJob", jpb.SubmitJobRequest(name=args.name or Path(args.file).name, requests=reqs),
                timeout_s=120.0)
    if job is None:
        return 1
    print(job.id)
    print(f"kvrelay: job {job.id}: {job.total} requests queued (kvrelay job status {job.id}; "
          f"kvrelay job results {job.id})", file=sys.stderr)
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


def cmd_job_results(args: argparse.Namespace) -> int:
    """Writes one JSON line per result (index, request_id, text, token_ids, finish, error)."""


    out = open(args.out, "w") if args.out else sys.stdout
    ch, stub = _stub(args)
    try:
        with ch:
            for r in stub.JobResults(jpb.JobResultsRequest(id=args.id, follow=args.follow), timeout=args.timeout):
                out.write(json.dumps(json_format.MessageToDict(r, preserving_proto_field_name=True,
                                                               always_print_fields_with_no_presence=True)) + "\n")
                out.flush()
    except grpc.RpcError as exc:
        return grpc_error(exc)
    finally:
        if args.out:
            out.close()
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
    jr = job.add_parser("results", help="a job's results as JSON lines")
    jr.add_argument("id")
    jr.add_argument("--follow", action="store_true", help="wait for the rest until the job finishes")
    jr.add_argument("--out", help="write to this file instead of stdout")
    jr.add_argument("--timeout", type=float, default=86400.0, help="give up after this many seconds")
    jr.set_defaults(func=cmd_job_results)
    for p in (js, jt, jc, jr):
        add_connect_flags(p)
