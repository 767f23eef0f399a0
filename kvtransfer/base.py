"""The KV transport interface: receivers expect KV into reserved blocks,
senders push a request's blocks layer by layer; both sides report an
ordered transfer state and failures as data.

Call order, sender side (prefill worker)::

    handle = sender.open(target)             # CONNECTING -> WAITING
    handle.send_layer(layer, src_blocks)      # any number of times, any thread,
                                              # never blocks (TRANSFERRING)
    handle.finish(first_token, logprob)       # after the last layer
    handle.wait(timeout) / await wait_async(handle, timeout)  # DONE or FAILED

Receiver side (decode worker)::

    handle = receiver.expect(transfer_id, block_ids)   # WAITING
    ... the sender writes into those blocks ...
    await wait_async(handle, lease)                     # DONE (result) or FAILED
    receiver.cancel(transfer_id)                        # always, when done with it
"""

from __future__ import annotations

import asyncio
import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from kvtransfer.errors import KVTransferError, TransferTimeout

TransferId = str
BlockId = int


class Transport(enum.StrEnum):
    """The KV transports kvtransfer implements (the config's and the wire's word for each)."""

    TCP = "tcp"
    """Bytes over sockets, our own framing (kvtransfer/tcp.py)."""
    NIXL = "nixl"
    """The receiver READs the sender's registered memory through a NIXL agent (kvtransfer/nixl.py)."""
    LOCAL = "local"
    """Same host: the receiver copies from the sender's shared memory (kvtransfer/local.py)."""


AUTO = "auto"
"""``kv.transport: auto``: nixl where the host has RDMA devices and NIXL imports, else tcp."""


class TransferState(enum.IntEnum):
    """Ordered: a transfer only moves forward, except to FAILED from anywhere."""

    FAILED = 0
    CONNECTING = 1
    WAITING = 2
    TRANSFERRING = 3
    DONE = 4


@dataclass(slots=True, frozen=True)
class TransferTarget:
    """Where a sender writes: the receiver's endpoint and reserved blocks."""

    endpoint: str
    transfer_id: TransferId
    block_ids: tuple[BlockId, ...]
    """Destination blocks; ``send_layer``'s ``first`` indexes into them."""
    layout_hash: str
    socket_buffer_bytes: int | None = None
    """Per link: socket buffers (the link's bandwidth-delay product); None = the sender's config."""
    encrypt: bool | None = None
    """Per link: encrypt the payloads; None = the sender's config."""
    pull: bool | None = None
    """Per link: offer the receiver to pull (shared memory, NIXL); False = bytes over TCP."""


@dataclass(slots=True, frozen=True)
class TransferResult:
    """What a completed transfer delivered besides the KV itself."""

    first_token_id: int
    first_logprob: float
    nbytes: int
    seconds: float


class TransferHandle:
    """Thread-safe state of one transfer (either side)."""

    def __init__(self, transfer_id: TransferId) -> None:
        self.transfer_id = transfer_id
        self._state = TransferState.CONNECTING
        self._error: KVTransferError | None = None
        self._result: TransferResult | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[[TransferHandle], None]] = []

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

    def add_done_callback(self, cb: Callable[[TransferHandle], None]) -> None:
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


async def wait_async(handle: TransferHandle, timeout_s: float) -> TransferResult:
    """Awaits a transfer; returns its result or raises its KVTransferError."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settled(h: TransferHandle) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

    handle.add_done_callback(settled)
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except asyncio.TimeoutError:
        handle.fail(f"not complete within {timeout_s:.1f} s")
        if handle.poll() is not TransferState.DONE:
            raise TransferTimeout(handle.transfer_id, f"not complete within {timeout_s:.1f} s") from None
    if handle.poll() is TransferState.DONE:
        return handle.result()
    raise handle.failure()


class SendHandle(TransferHandle, ABC):
    @abstractmethod
    def send_layer(self, layer: int, src_blocks: list[BlockId], first: int) -> None:
        """Queues K and V of ``layer`` for ``src_blocks`` (this worker's
        block ids) into target blocks ``[first, first + len(src_blocks))``."""

    @abstractmethod
    def finish(self, first_token_id: int, first_logprob: float) -> None:
        """Declares every block sent; the receiver completes with this token."""

    @abstractmethod
    def quiesce(self, timeout_s: float) -> bool:
        """Waits until no thread reads this transfer's source blocks any more
        (call before freeing them after a failure); False on timeout."""


class KVSender(ABC):
    """Sender side of a transport, bound to this worker's KV cache."""

    name: str

    @abstractmethod
    def open(self, target: TransferTarget) -> SendHandle: ...

    @abstractmethod
    def close(self) -> None: ...


class KVReceiver(ABC):
    """Receiver side of a transport, bound to this worker's KV cache."""

    name: str
    endpoint: str
    bytes_received: int = 0
    """KV bytes landed since start."""

    @abstractmethod
    def expect(self, transfer_id: TransferId, block_ids: list[BlockId]) -> TransferHandle: ...

    @abstractmethod
    def cancel(self, transfer_id: TransferId) -> None:
        """Forgets a transfer; bytes that still arrive for it are discarded."""

    @abstractmethod
    def close(self) -> None: ...


def coalesce(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive block ids as (position in list, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


class KVBytes:
    """Zero-copy byte views into a (host) KV cache, by offset arithmetic:
    slicing one memoryview costs ~0.1 us, a torch view ~20 us."""

    def __init__(self, cache: KVCache) -> None:
        if cache.kv.device.type != "cpu":
            raise ValueError("KVBytes needs the KV cache in host memory")
        self.cache = cache
        self.mem = memoryview(cache.kv.view(-1).view(torch.uint8).numpy())
        self.block_bytes = cache.layout.block_bytes

    def run(self, layer: int, kind: int, first_block: int, count: int) -> memoryview:
        """K (kind 0) or V (kind 1) of ``layer`` for blocks [first, first + count)."""
        off = self.cache.block_offset(layer, kind, first_block)
        return self.mem[off:off + count * self.block_bytes]
