"""A KV cache in GPU memory, moved as bytes through pinned host buffers.

The TCP transport seals and writes host bytes; a cache in VRAM reaches it
through :class:`DeviceKV`, which has the attributes of a host cache's
:class:`~kvrelay.kvtransfer.memory.KVBytes` (``block_bytes``, ``kinds``,
``layer_block_bytes``) and, instead of zero-copy views, copies:

- **send** (:meth:`DeviceKV.stage`), called on the engine's thread when a
  layer's blocks are final: a CUDA event recorded on the engine's current
  stream, a copy stream of our own that waits for it, the blocks copied
  device-to-host into a pinned buffer, and a second event after the copies.
  The sender's thread waits for that event (:meth:`Staged.views`) before a
  byte is sealed: no byte leaves before the layer's writes are complete, and
  the engine goes on computing the next layer meanwhile.
- **receive** (:meth:`DeviceKV.landing`, :meth:`DeviceKV.land`): the frame's
  bytes are received (and authenticated) into a pinned buffer, then copied
  host-to-device on the copy stream, which the receiving thread waits for
  before the blocks count as landed.
- **send under a codec** (:meth:`DeviceKV.stage_coded`): the same, with the
  layer's planes encoded on the copy stream before the copy, so the host gets
  the coded bytes (kvtransfer/coded.py's payload).
- **pulled frames** (NIXL reads VRAM into VRAM): the MACs are computed and
  checked over host copies of the same blocks (:meth:`DeviceKV.read`).

Pinned buffers come from torch's caching host allocator, so steady traffic
does not pin and unpin memory for every frame. Tests: tests/unit/test_kv_cuda.py
(they run where CUDA is present; ``make gpu-check``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import KVCodec
from kvrelay.kvtransfer.codecs import encode, parts
from kvrelay.kvtransfer.memory import KVBytes, coalesce


@dataclass(slots=True)
class Staged:
    """Bytes of one or more layers' blocks on their way to the host: ``buf``
    (pinned) holds them once ``done`` completed, ordered layer, plane, block."""

    buf: torch.Tensor
    done: torch.cuda.Event | None
    """Recorded after the copies; None when nothing was enqueued (the bytes are there)."""
    coded: bool = False
    """``buf`` holds the layers' planes encoded (kvtransfer/coded.py's payload), not the cache's bytes."""

    def views(self, sizes: list[int]) -> list[memoryview]:
        """The bytes split into consecutive pieces of ``sizes``, after waiting for the copies."""
        if self.done is not None:
            self.done.synchronize()
        mem = memoryview(self.buf.numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray __buffer__ on 3.12+
        out, pos = [], 0
        for size in sizes:
            out.append(mem[pos:pos + size])
            pos += size
        if pos != len(mem):
            raise ValueError(f"{pos} bytes asked of a staged buffer of {len(mem)}")
        return out


@dataclass(slots=True)
class Landing:
    """A frame's bytes on their way to the device: received into ``buf``, then
    copied to the cache's byte offsets (``(offset, size)`` per piece, in order)."""

    buf: torch.Tensor
    pieces: list[tuple[int, int]]

    def views(self) -> list[memoryview]:
        mem = memoryview(self.buf.numpy())  # type: ignore[arg-type]  # as in Staged.views
        out, pos = [], 0
        for _, size in self.pieces:
            out.append(mem[pos:pos + size])
            pos += size
        return out


class DeviceKV:
    """Copies of a CUDA KV cache's blocks through pinned host memory (see the module's docstring)."""

    def __init__(self, cache: KVCache) -> None:
        if not cache.kv.is_cuda:
            raise ValueError("DeviceKV needs the KV cache in CUDA memory")
        if not cache.kv.is_contiguous():
            raise ValueError("DeviceKV needs a contiguous KV tensor")
        self.cache = cache
        self.dev = cache.kv.view(-1).view(torch.uint8)
        self.block_bytes = cache.layout.block_bytes
        """Bytes of one plane of one layer's block (as KVBytes.block_bytes)."""
        self.kinds = range(cache.layout.kinds)
        self.layer_block_bytes = cache.layout.kinds * self.block_bytes
        self.stream = torch.cuda.Stream(device=cache.kv.device)
        """Every copy runs here, beside the engine's compute."""

    def _pieces(self, layers: range, blocks: list[int]) -> list[tuple[int, int]]:
        """(byte offset, size) of each run of ``blocks`` in each plane of each layer, in that order."""
        return [(self.cache.block_offset(layer, kind, first), n * self.block_bytes)
                for layer in layers for kind in self.kinds for _, first, n in coalesce(blocks)]

    def _to_host(self, pieces: list[tuple[int, int]], after: torch.cuda.Event | None) -> Staged:
        buf = torch.empty(sum(size for _, size in pieces), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            pos = 0
            for off, size in pieces:
                buf[pos:pos + size].copy_(self.dev[off:off + size], non_blocking=True)
                pos += size
            done = torch.cuda.Event()
            done.record(self.stream)
        return Staged(buf, done)

    def stage(self, layers: range, blocks: list[int]) -> Staged:
        """Copies ``blocks`` of ``layers`` to the host once the work enqueued so far on the calling
        thread's current stream (the engine computing them) is complete; returns at once."""
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.dev.device))
        return self._to_host(self._pieces(layers, blocks), produced)

    def stage_coded(self, layers: range, blocks: list[int], codec: KVCodec) -> Staged:
        """As :meth:`stage`, the planes encoded under ``codec`` on the copy stream first (a GPU encodes at
        75-210 GB/s: benchmarks/RESULTS.md), so only the coded bytes cross to the host."""
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.dev.device))
        index = torch.tensor(blocks, device=self.dev.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)
            index.record_stream(self.stream)  # made on the caller's stream, read on ours
            out = [p for layer in layers for kind in self.kinds
                   for p in parts(encode(codec, self.cache.kv[layer, kind].index_select(0, index)))]
            buf = torch.empty(sum(p.numel() for p in out), dtype=torch.uint8, pin_memory=True)
            pos = 0
            for p in out:
                buf[pos:pos + p.numel()].copy_(p, non_blocking=True)
                pos += p.numel()
            done = torch.cuda.Event()
            done.record(self.stream)
        return Staged(buf, done, coded=True)

    def read(self, layers: range, blocks: list[int]) -> Staged:
        """Host copies of blocks written outside CUDA streams (a NIXL read that completed)."""
        return self._to_host(self._pieces(layers, blocks), None)

    def landing(self, layers: range, blocks: list[int]) -> Landing:
        """A pinned buffer to receive ``blocks`` of ``layers`` into (its views in the wire's order)."""
        pieces = self._pieces(layers, blocks)
        return Landing(torch.empty(sum(size for _, size in pieces), dtype=torch.uint8, pin_memory=True), pieces)

    def land(self, landing: Landing) -> None:
        """Copies a received frame into the cache; returns once the copies completed."""
        with torch.cuda.stream(self.stream):
            pos = 0
            for off, size in landing.pieces:
                self.dev[off:off + size].copy_(landing.buf[pos:pos + size], non_blocking=True)
                pos += size
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()


def kv_memory(cache: KVCache) -> KVBytes | DeviceKV:
    """The byte access a transport uses for ``cache``: zero-copy views of host memory, or copies through pinned
    buffers for a cache in CUDA memory."""
    return DeviceKV(cache) if cache.kv.is_cuda else KVBytes(cache)
