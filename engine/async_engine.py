"""Runs an engine (a :class:`~kvrelay.engine.interface.WorkerEngine`) on its own thread and exposes it to asyncio.

Lifecycle: ``start()`` from a running event loop starts the engine thread;
it steps while there is work and otherwise sleeps on its command queue.
Every engine call (add, abort, reserve, commit, ...) runs on that thread
through ``call``, so the engine itself is never touched concurrently.
Outputs are delivered to per-request asyncio queues. ``stop()`` ends the
thread; requests still streaming get an :class:`EngineStopped` error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvrelay.engine.interface import WorkerEngine
from kvrelay.engine.llm_engine import RequestOutput
from kvrelay.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine thread stopped (shutdown or a failed step)."""


class AsyncEngine:
    def __init__(self, engine: WorkerEngine, call_timeout_s: float = 60.0) -> None:
        self.engine = engine
        self.call_timeout_s = call_timeout_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.busy_s = 0.0
        """Seconds spent in engine steps since start."""
        self.failure: Exception | None = None
        """Why the engine thread died (a failed step); None while it runs."""
        self.dead = asyncio.Event()
        """Set when the engine thread died of a failed step (not at a normal stop); a new one at each start."""

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.dead = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._cmds.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop :meth:`start` ran in."""
        if self._loop is None:
            raise RuntimeError("the engine is not started (AsyncEngine.start)")
        return self._loop

    # -- engine thread -------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stopping.is_set():
            try:
                cmd = self._cmds.get(timeout=0.05) if not eng.has_unfinished() else self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._execute(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopping.is_set() or not eng.has_unfinished():
                continue
            t0 = time.perf_counter()
            try:
                outputs = eng.step()
            except Exception as exc:  # a bug in a step must not hang every client
                log.exception("engine step failed")
                self.failure = exc
                self._started_loop().call_soon_threadsafe(self.dead.set)
                self._stopping.set()  # calls fail fast from now on instead of waiting out their timeout
                self._fail_all(exc)
                return
            self.busy_s += time.perf_counter() - t0
            for out in outputs:
                self._deliver(out.request_id, out)
        self._fail_all(EngineStopped("engine stopped"))

    def _execute(self, cmd: tuple[Callable, tuple, asyncio.Future]) -> None:
        fn, args, fut = cmd
        try:
            result, error = fn(*args), None
        except Exception as exc:  # returned to the awaiting caller
            result, error = None, exc
        self._started_loop().call_soon_threadsafe(_resolve, fut, result, error)

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        q = self._streams.get(request_id)
        if q is not None:
            self._started_loop().call_soon_threadsafe(q.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self._streams):
            self._deliver(rid, exc)

    # -- asyncio side --------------------------------------------------------
    async def call(self, fn: Callable, *args: Any) -> Any:
        """Runs ``fn(*args)`` on the engine thread between steps."""
        if self._stopping.is_set():
            raise EngineStopped("engine stopped")
        fut = self._started_loop().create_future()
        self._cmds.put((fn, args, fut))
        return await asyncio.wait_for(fut, self.call_timeout_s)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def outputs(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yields a request's outputs until it finishes."""
        while True:
            item = await q.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, salt: str = "",
                       hold_blocks: bool = False, account: object = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Runs a request here; leaving the iteration early aborts it. ``account``
        and ``priority``: see ``LLMEngine.add_request``."""
        q = self.open_stream(request_id)
        finished = False
        try:
            await self.call(self.engine.add_request, request_id, prompt, params, salt, hold_blocks, account,
                            priority)
            async for out in self.outputs(request_id, q):
                finished = out.finished
                yield out
        finally:
            self.close_stream(request_id)
            if not finished and not self._stopping.is_set():
                await asyncio.shield(self.call(self.engine.abort_request, request_id))


def _resolve(fut: asyncio.Future, result: Any, error: Exception | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
