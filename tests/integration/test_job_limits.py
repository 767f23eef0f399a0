"""A tenant trying to fill the router's disk with batch jobs (issue 33,
finding 1), on real processes: jobs submitted in a loop stop at the
tenant's max_stored_jobs and max_stored_job_bytes; a submission counts
against requests_per_minute; one tenant's huge jobs do not hold another's
submission behind them on the checker thread; and a router whose disk runs
low refuses new jobs, then new requests, saying so in its status and
metrics, while the audit log keeps every record and DeleteJob still works.
Other tenants are served throughout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvrelay.router.core.auth import token_sha256
from kvrelay.router.core.disk import MEASURE_EVERY_S
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from tests.integration.helpers import running_cluster

pytestmark = pytest.mark.model

TENANTS = {"filler": {"max_stored_jobs": 3}, "bulky": {"max_stored_job_bytes": 6000},
           "rapid": {"requests_per_minute": 2}, "flooder": {}, "victim": {}}


def _config(**records) -> dict:
    return {
        "router": {"port": 0, "http_port": None, "liveness": {"heartbeat_interval_s": 0.25},
                   "records": records},
        "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 0}, "decode": {"replicas": 1}}],
        "workers": {"threads": 1},
        "cache": {"memory_gib": 0.25},
        "tenants": [{"name": name, "token_sha256": token_sha256(f"tok-{name}"), **policy}
                    for name, policy in TENANTS.items()],
    }


@pytest.fixture(scope="module")
def cluster(plumbing_model):
    with running_cluster(_config(), plumbing_model) as lc:
        yield lc


@contextlib.contextmanager
def jobs(lc, tenant: str):
    with lc.dialer(f"tok-{tenant}").sync(lc.router_address) as ch:
        yield jgrpc.JobsStub(ch)


def _reqs(n: int, prompt_tokens: int = 4) -> list[ipb.GenerateRequest]:
    return [ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[300 + (i + k) % 2000 for k in range(prompt_tokens)]),
                                max_tokens=1, ignore_eos=True) for i in range(n)]


def submit(lc, tenant: str, reqs: list[ipb.GenerateRequest]) -> jpb.Job:
    with jobs(lc, tenant) as stub:
        return stub.SubmitJob(jpb.SubmitJobRequest(name="j", requests=reqs), timeout=120)


def refused(lc, tenant: str, reqs: list[ipb.GenerateRequest]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        submit(lc, tenant, reqs)
    return err.value


def delete(lc, tenant: str, job_id: str) -> None:
    with jobs(lc, tenant) as stub:
        stub.DeleteJob(jpb.DeleteJobRequest(id=job_id), timeout=60)


def generate(lc, tenant: str = "victim", request_id: str = "") -> list[ipb.GenerateResponse]:
    with lc.dialer(f"tok-{tenant}").sync(lc.router_address) as ch:
        return list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=list(range(200, 220))), max_tokens=2, ignore_eos=True, request_id=request_id),
            timeout=60))


def test_jobs_in_a_loop_stop_at_the_tenants_stored_jobs(cluster):
    ids = [submit(cluster, "filler", _reqs(2)).id for _ in range(3)]
    err = refused(cluster, "filler", _reqs(2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'filler' stores 3 jobs, its max_stored_jobs quota" in err.details()
    assert submit(cluster, "victim", _reqs(1)).total == 1  # nobody else's limit
    delete(cluster, "filler", ids[0])
    assert submit(cluster, "filler", _reqs(2)).total == 2  # room again once one is deleted
    assert sum(len(m.token_ids) for m in generate(cluster)) == 2


def test_a_tenants_stored_bytes_are_bounded(cluster):
    job = _reqs(40, 64)
    assert 3000 < sum(r.ByteSize() for r in job) < 6000  # one fits in its 6,000 bytes, two do not
    first = submit(cluster, "bulky", job)
    err = refused(cluster, "bulky", job)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over its max_stored_job_bytes quota (6000)" in err.details()
    delete(cluster, "bulky", first.id)
    assert submit(cluster, "bulky", job).total == 40


def test_a_submission_counts_against_requests_per_minute(cluster):
    """rapid's bucket holds 2 requests: its first submission takes one, and the job's request
    (which may run at once) another; submissions in a loop are refused by the third at the latest."""
    accepted, err = 0, None
    for _ in range(3):
        try:
            submit(cluster, "rapid", _reqs(1))
            accepted += 1
        except grpc.RpcError as exc:
            err = exc
            break
    assert 1 <= accepted <= 2 and err is not None, accepted
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_minute quota (2; a job submission counts as one request)" in err.details()
    assert int(dict(err.trailing_metadata())["retry-after-ms"]) > 0
    assert submit(cluster, "victim", _reqs(1)).total == 1


def test_huge_jobs_of_one_tenant_do_not_hold_up_anothers_submission(cluster):
    """Two jobs of 60,000 requests each (what the checker tokenizes for seconds) are in
    the checker when another tenant submits a one-request job: it is stored first.
    (A third submission of the flooder's, refused while two are checked, is
    tests/unit/test_job_checks.py's: here its timing would be the machine's.)"""
    done: dict[str, float] = {}
    huge = {f"flood{i}": jpb.SubmitJobRequest(name=f"flood{i}", requests=_reqs(60_000, 2)) for i in range(2)}
    started = threading.Barrier(3)

    def flood(key: str) -> None:
        with jobs(cluster, "flooder") as stub:
            started.wait(30)
            job = stub.SubmitJob(huge[key], timeout=300)
        done[key] = time.monotonic()
        delete(cluster, "flooder", job.id)  # nothing of it needs to run

    threads = [threading.Thread(target=flood, args=(key,)) for key in huge]
    for t in threads:
        t.start()
    started.wait(30)
    # both jobs (built beforehand) reach the router in milliseconds and take it seconds to check; on a
    # machine slow enough that they have not arrived yet, the one-request job is simply first anyway
    time.sleep(0.5)
    assert submit(cluster, "victim", _reqs(1)).total == 1
    done["victim"] = time.monotonic()
    for t in threads:
        t.join(300)
    assert done["victim"] < min(done["flood0"], done["flood1"]), done
    assert sum(len(m.token_ids) for m in generate(cluster)) == 2


# -- a disk running low ---------------------------------------------------------------------------------------------
MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs for the router's records (root only: it mounts one)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    where = tmp_path / "records"
    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True,
                         text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(path: Path, mib: int) -> None:
    with path.open("wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MiB))


def _storage(lc) -> str:
    with lc.channel(operator=True) as ch:
        return wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10).storage


def _refusing(lc) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{lc.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvrelay_router_refusing{")}


def test_a_router_short_of_disk_refuses_jobs_then_requests_and_loses_no_audit_record(plumbing_model, small_disk):
    raw = _config(jobs_db=str(small_disk / "jobs.sqlite"), audit_log=str(small_disk / "audit.jsonl"),
                  usage_db=str(small_disk / "usage.sqlite"), min_free_bytes_for_jobs=40 * MiB,
                  min_free_bytes=16 * MiB)
    with running_cluster(raw, plumbing_model) as lc:
        kept = submit(lc, "flooder", _reqs(4))
        assert "accepting" in _storage(lc) and _refusing(lc) == {"jobs": 0.0, "requests": 0.0}
        _fill(small_disk / "someone-elses-file", 30)  # 64 - 30 MiB: under the jobs' reserve
        time.sleep(MEASURE_EVERY_S)
        err = refused(lc, "flooder", _reqs(1))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "router.records.min_free_bytes_for_jobs = 40.0 MiB" in err.details()
        assert "REFUSING new jobs" in _storage(lc) and _refusing(lc) == {"jobs": 1.0, "requests": 0.0}
        assert generate(lc, request_id="served-on-a-low-disk")  # requests still are, each with its audit record
        delete(lc, "flooder", kept.id)  # a durable audit write: there is room for it
        _fill(small_disk / "someone-elses-file", 52)  # 12 MiB left: under the requests' reserve
        time.sleep(MEASURE_EVERY_S)
        with pytest.raises(grpc.RpcError) as err2:
            generate(lc)
        assert err2.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "router.records.min_free_bytes = 16.0 MiB" in err2.value.details()
        assert "REFUSING new jobs and requests" in _storage(lc)
        (small_disk / "someone-elses-file").unlink()
        time.sleep(MEASURE_EVERY_S)
        assert submit(lc, "flooder", _reqs(1)).total == 1 and generate(lc)
    audit = (small_disk / "audit.jsonl").read_text()
    assert '"request_id":"served-on-a-low-disk"' in audit  # the request served on a low disk is on record
    assert f'"action":"deleted","job":"{kept.id}"' in audit
