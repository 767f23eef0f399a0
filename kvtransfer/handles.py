"""The transfer handle every transport uses (state that only moves forward,
failures as data, done callbacks) and ``wait_async``, the way to await one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from kvrelay.kvtransfer.base import (
    BlockId,
    TransferHandle,
    TransferId,
    TransferResult,
    TransferState,
)
from kvrelay.kvtransfer.errors import KVTransferError, TransferTimeout


class StateHandle(TransferHandle):
    """Thread-safe state of one transfer (either side): the TransferHandle
    implementation. Transports move it on with ``advance``, ``complete`` and
    ``fail``."""

    def __init__(self, transfer_id: TransferId) -> None:
        self.transfer_id = transfer_id
        self._state = TransferState.CONNECTING
        self._error: KVTransferError | None = None
        self._result: TransferResult | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[[TransferHandle], object]] = []

    def poll(self) -> TransferState:
        return self._state

    def failure(self) -> KVTransferError | None:
        return self._error

    def result(self) -> TransferResult | None:
        return self._result

    def advance(self, state: TransferState) -> None:
        """Moves forward (never backward, never out of FAILED)."""
        with self._lock:
            if self._state in (TransferState.FAILED, TransferState.DONE) or state <= self._state:
                return
            self._state = state
        if state is TransferState.DONE:
            self._settle()

    def complete(self, result: TransferResult) -> None:
        with self._lock:
            if self._state in (TransferState.FAILED, TransferState.DONE):
                return
            self._result = result
            self._state = TransferState.DONE
        self._settle()

    def fail(self, reason: str, blocks: list[BlockId] | None = None) -> None:
        """FAILED from any state but DONE; the first reason wins."""
        with self._lock:
            if self._state in (TransferState.FAILED, TransferState.DONE):
                return
            self._state = TransferState.FAILED
            self._error = KVTransferError(self.transfer_id, reason, blocks)
        self._settle()

    def _settle(self) -> None:
        self._done.set()
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[TransferHandle], object]) -> None:
        """Calls ``cb(handle)`` once DONE or FAILED (at once if already so)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def wait(self, timeout_s: float) -> TransferState:
        """Blocks until DONE or FAILED; on timeout the transfer FAILS."""
        if not self._done.wait(timeout_s):
            self.fail(f"not complete within {timeout_s:.1f} s")
        return self._state


def _resolve(fut: asyncio.Future) -> None:
    """Resolves ``fut`` with None unless it is already done (in its event loop's thread)."""
    if not fut.done():
        fut.set_result(None)


async def wait_async(handle: TransferHandle, timeout_s: float) -> TransferResult:
    """Awaits a transfer; returns its result or raises its KVTransferError."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settled(h: TransferHandle) -> None:
        loop.call_soon_threadsafe(_resolve, fut)

    handle.add_done_callback(settled)
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except TimeoutError:
        handle.fail(f"not complete within {timeout_s:.1f} s")
        if handle.poll() is not TransferState.DONE:
            raise TransferTimeout(handle.transfer_id, f"not complete within {timeout_s:.1f} s") from None
    if handle.poll() is TransferState.DONE:
        result = handle.result()
        if result is None:  # DONE comes with its result (complete)
            raise RuntimeError(f"transfer {handle.transfer_id} is DONE without a result")
        return result
    failure = handle.failure()
    if failure is None:  # FAILED comes with its reason (fail), and the wait ended DONE or FAILED
        raise RuntimeError(f"transfer {handle.transfer_id} ended {handle.poll().name} without a reason")
    raise failure
