"""What a vLLM engine's kvrelay connector (runtime/vllm_connector.py) and the
worker's engine (runtime/vllm_engine.py) share, with no import of vLLM: the
:class:`Bridge` of one engine, registered under its engine id before vLLM
starts, and the layer-by-layer sending of prompts' blocks (:class:`LayerSends`)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from opentelemetry.trace import INVALID_SPAN, Span

from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import SendHandle

PARAMS_KEY = "kvrelay"
"""The key of ``kv_transfer_params`` a kvrelay request carries: ``{"id": ..., "send": bool}``."""


@dataclass(slots=True)
class _Send:
    """One request whose prompt blocks stream to a decode worker."""

    handle: SendHandle
    start_block: int
    num_blocks: int
    sent: list[int]
    """Per layer: blocks of the prompt sent so far (from block 0)."""
    span: Span = INVALID_SPAN
    """The transfer's span: an event per layer's blocks queued for sending."""


@dataclass(slots=True, frozen=True)
class StepSend:
    """A send request's part of one step: its blocks so far and the tokens computed at its end."""

    request_id: str
    block_ids: tuple[int, ...]
    end: int
    num_prompt_tokens: int


class LayerSends:
    """The sends in flight and, per layer, the blocks that layer finished (vLLM's
    block size; blocks the decode worker caches, before ``start_block``, are skipped)."""

    def __init__(self, block_size: int, num_layers: int) -> None:
        self.block_size = block_size
        self.num_layers = num_layers
        self._active: dict[str, _Send] = {}

    def add(self, request_id: str, handle: SendHandle, start_block: int, num_blocks: int,
            span: Span = INVALID_SPAN) -> None:
        """Streams ``num_blocks`` prompt blocks from ``start_block`` on (``span``: the transfer's)."""
        self._active[request_id] = _Send(handle, start_block, num_blocks, [start_block] * self.num_layers, span)

    def remove(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def abandon(self, request_id: str, reason: str, timeout_s: float = 10.0) -> None:
        """Fails a send whose blocks vLLM is about to reuse, and returns once no transport
        thread reads them (or after ``timeout_s``)."""
        a = self._active.pop(request_id, None)
        if a is not None:
            a.handle.fail(reason)
            a.handle.quiesce(timeout_s)

    def on_layer(self, layer: int, step: list[StepSend]) -> None:
        bs = self.block_size
        for s in step:
            a = self._active.get(s.request_id)
            if a is None:
                continue
            upto = blocks_for(s.end, bs) if s.end >= s.num_prompt_tokens else s.end // bs
            upto = min(upto, a.start_block + a.num_blocks, len(s.block_ids))
            lo = a.sent[layer]
            if upto > lo:
                a.handle.send_layer(layer, list(s.block_ids[lo:upto]), lo - a.start_block)
                a.sent[layer] = upto
                if a.span.is_recording():
                    a.span.add_event("layer", {"kvrelay.layer": layer, "kvrelay.kv.blocks": upto - lo})


@dataclass(slots=True)
class Bridge:
    """What the kvrelay worker and the connector's two instances share (one engine)."""

    sends: LayerSends | None = None
    """Set with the cache (needs the block size and layer count)."""
    cache: KVCache | None = None
    """vLLM's KV tensors as a kvrelay cache (set when vLLM registers them)."""
    layer_index: dict[str, int] = field(default_factory=dict)
    reservations: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    """Receive requests waiting for their blocks: resolved with (block ids, first block to fill)."""
    internal: dict[str, str] = field(default_factory=dict)
    """kvrelay request id -> vLLM's internal id (known once the scheduler saw the request)."""
    step_sends: list[StepSend] = field(default_factory=list)
    """The send requests of the step being computed."""
    step_tokens: list[tuple[str, int, int]] = field(default_factory=list)
    """(kvrelay request id, tokens computed before, tokens scheduled) of the steps scheduled since
    the engine last read it (usage, prefill and decode counts)."""
    sent: set[str] = field(default_factory=set)
    """Internal ids whose held blocks may be freed (reported as finished_sending)."""
    received: set[str] = field(default_factory=set)
    """Internal ids whose KV is in place, or will never be written (reported as finished_recving)."""
    local_hits: dict[str, int] = field(default_factory=dict)
    """Receive requests: prompt tokens this worker's own prefix cache held (the rest arrives)."""
    held: set[str] = field(default_factory=set)
    """kvrelay ids of finished send requests whose blocks vLLM keeps for the transfer."""
    model_name: str = ""
    """The model's name in the cache's KVLayout, set by the engine before vLLM starts."""


_BRIDGES: dict[str, Bridge] = {}


def register_bridge(engine_id: str, bridge: Bridge) -> None:
    """Makes ``bridge`` the one the connector of engine ``engine_id`` uses."""
    _BRIDGES[engine_id] = bridge


def unregister_bridge(engine_id: str) -> None:
    _BRIDGES.pop(engine_id, None)


def bridge_for(engine_id: str) -> Bridge:
    """The bridge of engine ``engine_id``; RuntimeError when none was registered."""
    if engine_id not in _BRIDGES:
        raise RuntimeError(f"no kvrelay bridge for vLLM engine {engine_id!r}: start vLLM pools through "
                           "kvrelay's worker (runtime/vllm_engine.py)")
    return _BRIDGES[engine_id]


