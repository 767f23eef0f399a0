"""``kvrelay job delete`` on a real cluster: a small job runs, its owner
deletes it through the CLI, the job is gone from the router (and its
deletion in the router's audit log, which still verifies); deleting it
again, or a job that never was, names it as unknown."""

from __future__ import annotations

import json

import grpc
import pytest

from kvrelay.cli.main import main
from kvrelay.router.governance.audit import query, verify
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc
from tests.integration.helpers import cluster_user, wait_until

pytestmark = pytest.mark.model


def _state(shared_cluster, job_id: str) -> int:
    with shared_cluster.channel() as ch:
        return jgrpc.JobsStub(ch).GetJob(jpb.GetJobRequest(id=job_id), timeout=10).state


def test_job_delete_through_the_cli(shared_cluster, tmp_path, capsys, monkeypatch):
    f = tmp_path / "job.jsonl"
    f.write_text("\n".join(json.dumps({"token_ids": [400 + i, 401, 402, 403], "max_tokens": 4, "ignore_eos": True})
                           for i in range(2)) + "\n")
    r = cluster_user(shared_cluster, monkeypatch)
    assert main(["job", "submit", str(f), *r]) == 0
    job_id = capsys.readouterr().out.strip()
    assert wait_until(lambda: _state(shared_cluster, job_id) == jpb.JOB_STATE_DONE, 120, 0.3)
    assert main(["job", "delete", job_id, *r]) == 0
    assert capsys.readouterr().out.strip() == f"deleted job {job_id}: 2 requests and their results"
    with pytest.raises(grpc.RpcError) as err:
        _state(shared_cluster, job_id)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert main(["job", "delete", job_id, *r]) == 1
    assert f"NOT_FOUND: no job '{job_id}'" in capsys.readouterr().err
    audit = shared_cluster.cfg.router.records.audit_log
    deleted = [x for x in query(audit, kind="job") if x.get("job") == job_id]
    assert [(x["action"], x.get("requests"), x.get("requests_deleted")) for x in deleted] == [
        ("submitted", 2, None), ("deleted", None, 2)]
    assert verify(audit).ok
