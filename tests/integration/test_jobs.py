"""Batch jobs on a real cluster: submitted through the CLI and the API,
stored in SQLite at the router; a router killed (SIGKILL) and restarted in
the middle of a 120-request job resumes it, and every result is present
exactly once afterwards."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from kvrelay.cli.main import main
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc
from tests.integration.helpers import cluster_user, running_cluster, wait_until, workers

pytestmark = pytest.mark.model

CONFIG = {
    "router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 64},
               "liveness": {"heartbeat_interval_s": 0.25}, "admission": {"job_concurrency": 8}},
    "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
}
N = 120


@pytest.fixture(scope="module")
def jobs_cluster(plumbing_model):
    with running_cluster(CONFIG, plumbing_model) as lc:
        yield lc


def _stub(lc):
    ch = lc.channel()
    return ch, jgrpc.JobsStub(ch)


def _registered(lc) -> int:
    try:
        return len(workers(lc))
    except grpc.RpcError:  # this process's connection to the old router is still backing off
        return 0


def _results(lc, job_id: str) -> list[jpb.JobResult]:
    ch, stub = _stub(lc)
    with ch:
        return list(stub.JobResults(jpb.JobResultsRequest(id=job_id), timeout=60))


def test_router_restart_mid_job_every_result_exactly_once(jobs_cluster):
    reqs = [ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[300 + (i * 7 + k) % 3000 for k in range(16)]),
                                max_tokens=2, ignore_eos=True) for i in range(N)]
    ch, stub = _stub(jobs_cluster)
    with ch:
        job = stub.SubmitJob(jpb.SubmitJobRequest(name="restart", requests=reqs), timeout=60)
    assert job.total == N and job.state == jpb.JOB_STATE_QUEUED
    assert wait_until(lambda: len(_results(jobs_cluster, job.id)) >= 24, 180, 0.05)
    before = {r.index: r for r in _results(jobs_cluster, job.id)}
    print(f"{len(before)} of {N} results before the restart")
    assert len(before) < N  # the restart comes mid-job
    jobs_cluster.restart_router(kill=True)
    # workers find the new router on their next heartbeat; the job resumes from the database
    assert wait_until(lambda: _registered(jobs_cluster) == 2, 60, 0.5)
    ch, stub = _stub(jobs_cluster)
    with ch:
        assert wait_until(lambda: stub.GetJob(jpb.GetJobRequest(id=job.id), timeout=10).state
                          == jpb.JOB_STATE_DONE, 300, 0.5)
        final = stub.GetJob(jpb.GetJobRequest(id=job.id), timeout=10)
    assert final.completed == N and final.failed == 0 and final.finished_unix > 0
    results = _results(jobs_cluster, job.id)
    assert sorted(r.index for r in results) == list(range(N))  # every one, once
    assert all(len(r.token_ids) == 2 and not r.error and r.finish.usage.completion_tokens == 2 for r in results)
    after = {r.index: r for r in results}
    for i, r in before.items():  # finished before the restart: stored once, never redone
        assert after[i] == r


def test_job_cli_submit_status_results_and_bad_input(jobs_cluster, tmp_path, capsys, monkeypatch):
    f = tmp_path / "job.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "What is a research network?", "max_tokens": 4},
        {"messages": [{"role": "user", "content": "Name a city in Canada."}], "max_tokens": 4, "temperature": 0.7,
         "seed": 3},
        {"token_ids": [400, 401, 402, 403], "max_tokens": 3, "ignore_eos": True},
    ]) + "\n")
    r = cluster_user(jobs_cluster, monkeypatch)
    assert main(["job", "submit", str(f), *r]) == 0
    job_id = capsys.readouterr().out.strip()
    ch, stub = _stub(jobs_cluster)
    with ch:
        assert wait_until(lambda: stub.GetJob(jpb.GetJobRequest(id=job_id), timeout=10).state
                          == jpb.JOB_STATE_DONE, 120, 0.3)
    assert main(["job", "status", job_id, *r]) == 0
    assert "done" in capsys.readouterr().out
    out = tmp_path / "results.jsonl"
    assert main(["job", "results", job_id, "--out", str(out), *r]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2] and all(x["error"] == "" for x in lines)
    assert len(lines[2]["token_ids"]) == 3 and lines[0]["text"]
    followed = tmp_path / "followed.jsonl"  # a finished job: follow ends at once, each result once
    assert main(["job", "results", job_id, "--follow", "--out", str(followed), *r]) == 0
    assert [json.loads(x)["index"] for x in followed.read_text().splitlines()] == [0, 1, 2]
    # bad input: a malformed line names the file and line, before sending; so does one the router refuses
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    assert main(["job", "submit", str(bad), *r]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    bad.write_text('{"prompt": "ok"}\n\n{"prompt": "x", "max_tokens": 0}\n')
    assert main(["job", "submit", str(bad), *r]) == 2
    assert "bad.jsonl:3: max_tokens must be >= 1, got 0" in capsys.readouterr().err
    bad.write_text('{"prompt": "ok"}\n\n{"token_ids": [1, 999999999]}\n')  # out of the vocabulary: the router says
    assert main(["job", "submit", str(bad), *r]) == 1
    assert "bad.jsonl:3: requests[1]: token ids must be in" in capsys.readouterr().err
    assert main(["job", "status", "nope", *r]) == 1
    assert "no job 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("requests,message", [
    ([ipb.GenerateRequest(prompt="hi")] * 100_001, "job has 100001 requests; at most 100000"),
    ([ipb.GenerateRequest(prompt="hi"), ipb.GenerateRequest(prompt="hi", max_tokens=0)],
     "requests[1]: max_tokens must be >= 1, got 0"),
    ([ipb.GenerateRequest(prompt="x" * (2 << 20))], "requests[0]: 2097157 bytes; at most 1048576 (1 MiB) per request"),
])
def test_a_job_over_a_limit_or_with_a_bad_request_is_invalid_argument(jobs_cluster, requests, message):
    ch, stub = _stub(jobs_cluster)
    with ch, pytest.raises(grpc.RpcError) as err:
        stub.SubmitJob(jpb.SubmitJobRequest(name="limits", requests=requests), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == message


def test_cancel_stops_a_job(jobs_cluster):
    reqs = [ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[500 + i] * 8), max_tokens=2, ignore_eos=True)
            for i in range(300)]
    ch, stub = _stub(jobs_cluster)
    with ch:
        job = stub.SubmitJob(jpb.SubmitJobRequest(name="cancel", requests=reqs), timeout=60)
        cancelled = stub.CancelJob(jpb.CancelJobRequest(id=job.id), timeout=10)
        assert cancelled.state == jpb.JOB_STATE_CANCELLED
        time.sleep(1.0)
        done = stub.GetJob(jpb.GetJobRequest(id=job.id), timeout=10)
    assert done.completed + done.failed < 300 and done.state == jpb.JOB_STATE_CANCELLED
