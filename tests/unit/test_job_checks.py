"""The job checker's fairness (router/frontends/job_checks.py), with a check
that waits for the test's go-ahead per chunk: tenants take turns chunk by
chunk, a tenant's third submission is refused while two are checked, a
refused request ends its submission at once, and a caller that leaves is
dropped."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.frontends import job_checks
from kvrelay.router.frontends.job_checks import CHUNK, MAX_PER_TENANT, FairChecker
from kvrelay.v1 import inference_pb2 as ipb


class Gated:
    """A check that records (owner, first index) of each chunk and waits for ``go`` before returning."""

    def __init__(self, bad: int | None = None) -> None:
        self.chunks: list[tuple[str, int]] = []
        self.go = threading.Semaphore(0)
        self.bad = bad

    def __call__(self, requests, start: int, owner: str) -> str | None:
        self.chunks.append((owner, start))
        assert self.go.acquire(timeout=10)
        if self.bad is not None and start <= self.bad < start + len(requests):
            return f"requests[{self.bad}]: bad"
        return None


def _reqs(n: int) -> list[ipb.GenerateRequest]:
    return [ipb.GenerateRequest(max_tokens=1) for _ in range(n)]


async def _until(cond, timeout_s: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < end
        await asyncio.sleep(0.005)


def test_tenants_take_turns_chunk_by_chunk_and_a_third_submission_is_refused():
    async def go():
        check = Gated()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fc = FairChecker(check, pool)
            huge = [asyncio.create_task(fc.check_job("a", _reqs(10 * CHUNK))) for _ in range(MAX_PER_TENANT)]
            await _until(lambda: len(check.chunks) == 1)
            with pytest.raises(RouterError) as err:
                await fc.check_job("a", _reqs(1))
            assert err.value.kind is ErrorKind.OVERLOADED and "has 2 jobs being checked" in err.value.message
            small = asyncio.create_task(fc.check_job("b", _reqs(1)))
            for _ in range(3):
                check.go.release()
            assert await asyncio.wait_for(small, 10) is None  # after one chunk of a's, not ten
            await _until(lambda: len(check.chunks) >= 3)
            assert check.chunks[:3] == [("a", 0), ("b", 0), ("a", CHUNK)]
            for _ in range(2 * 10 * CHUNK):
                check.go.release()
            assert await asyncio.gather(*huge) == [None, None]
            assert sorted(start for owner, start in check.chunks if owner == "a") == \
                sorted([i * CHUNK for i in range(10)] * 2)
            await fc.aclose()
    asyncio.run(go())


def test_a_refused_request_ends_its_submission_naming_it():
    async def go():
        check = Gated(bad=CHUNK + 3)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fc = FairChecker(check, pool)
            for _ in range(10):
                check.go.release()
            assert await fc.check_job("a", _reqs(5 * CHUNK)) == f"requests[{CHUNK + 3}]: bad"
            assert len(check.chunks) == 2  # nothing after the chunk that held it
            await fc.aclose()
    asyncio.run(go())


def test_a_caller_that_leaves_is_dropped_and_frees_its_place(monkeypatch):
    monkeypatch.setattr(job_checks, "MAX_PER_TENANT", 1)

    async def go():
        check = Gated()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fc = FairChecker(check, pool)
            first = asyncio.create_task(fc.check_job("a", _reqs(4 * CHUNK)))
            await _until(lambda: len(check.chunks) == 1)
            first.cancel()
            check.go.release()
            await _until(lambda: fc.pending("a") == 0)
            assert len(check.chunks) == 1  # no chunk checked for a caller that left
            check.go.release()
            assert await fc.check_job("a", _reqs(1)) is None
            await fc.aclose()
    asyncio.run(go())
