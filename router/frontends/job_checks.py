"""Checking submitted jobs (tokenizing every prompt) on one thread, fairly
between tenants.

A job of 100,000 requests takes the checker seconds. Checked whole and in
arrival order, one tenant submitting such jobs in a loop would hold every
other tenant's submission behind its own. Here each submission is checked
CHUNK requests at a time, and the tenants with submissions waiting take
turns chunk by chunk: another tenant's small job waits for at most one chunk
of each tenant ahead of it. A tenant may have MAX_PER_TENANT submissions
being checked at once; one more is refused (RESOURCE_EXHAUSTED), not queued."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.v1 import inference_pb2 as ipb

CHUNK = 256
"""Requests checked in one turn."""
MAX_PER_TENANT = 2
"""Submissions of one tenant being checked at once."""

Check = Callable[[Sequence[ipb.GenerateRequest], int, str], str | None]
"""(requests, index of the first, owner) -> why the first bad one is refused (``requests[i]: ...``), or None."""


@dataclass(slots=True)
class _Submission:
    requests: Sequence[ipb.GenerateRequest]
    done: asyncio.Future
    at: int = 0
    """Requests checked so far."""


@dataclass(slots=True)
class _Turns:
    waiting: dict[str, collections.deque[_Submission]] = field(default_factory=dict)
    ring: collections.deque[str] = field(default_factory=collections.deque)
    """Tenants with submissions waiting, in the order they take their next turn."""


class FairChecker:
    """Runs ``check`` over submitted jobs on ``executor``, chunk by chunk, tenants in turn."""

    def __init__(self, check: Check, executor: concurrent.futures.Executor) -> None:
        self.check = check
        self.executor = executor
        self._turns = _Turns()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def pending(self, owner: str) -> int:
        """``owner``'s submissions waiting or being checked."""
        return len(self._turns.waiting.get(owner, ()))

    async def check_job(self, owner: str, requests: Sequence[ipb.GenerateRequest]) -> str | None:
        """Why the job is refused (``requests[i]: ...``; None: every request passes). A tenant
        with MAX_PER_TENANT submissions being checked: RouterError OVERLOADED."""
        if self.pending(owner) >= MAX_PER_TENANT:
            raise RouterError(ErrorKind.OVERLOADED, f"tenant {owner!r} has {MAX_PER_TENANT} jobs being checked; "
                                                    "submit the next when one of them is stored", retry_after_s=1.0)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="job checks")
        sub = _Submission(requests, asyncio.get_running_loop().create_future())
        queue = self._turns.waiting.setdefault(owner, collections.deque())
        if not queue:
            self._turns.ring.append(owner)
        queue.append(sub)
        self._wake.set()
        return await sub.done  # cancelled (the caller left): the runner drops it at its next turn

    async def _run(self) -> None:
        turns = self._turns
        while True:
            if not turns.ring:
                self._wake.clear()
                await self._wake.wait()
                continue
            owner = turns.ring.popleft()
            queue = turns.waiting[owner]
            if not queue[0].done.done():
                await self._one_chunk(queue[0], owner)
            if queue[0].done.done():
                queue.popleft()
            if queue:
                turns.ring.append(owner)
            else:
                del turns.waiting[owner]

    async def _one_chunk(self, sub: _Submission, owner: str) -> None:
        """Checks the submission's next CHUNK requests; settles it when one is refused or none is left."""
        chunk = sub.requests[sub.at:sub.at + CHUNK]
        try:
            problem = await asyncio.get_running_loop().run_in_executor(self.executor, self.check, chunk, sub.at,
                                                                       owner)
        except Exception as exc:  # a bug in the check: that submission fails, the checker goes on
            if not sub.done.done():
                sub.done.set_exception(exc)
            return
        sub.at += len(chunk)
        if not sub.done.done() and (problem is not None or sub.at >= len(sub.requests)):
            sub.done.set_result(problem)

    async def aclose(self) -> None:
        """Stops the runner; submissions still waiting are cancelled."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for queue in self._turns.waiting.values():
            for sub in queue:
                sub.done.cancel()
