"""Layer-wise KV streaming: the engine's layer hook pushes each layer's
finished blocks of every request being transferred, while later layers are
still being computed.

A block of layer L is sent once all of its tokens have been computed at
that layer: full blocks as soon as their chunk is done, the last (partial)
block with the final chunk. Blocks the decode worker already caches
(before ``start_block``) are skipped. Runs on the engine thread; sending
only queues work for the transport's threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import INVALID_SPAN, Span

from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.kvtransfer.base import SendHandle


@dataclass(slots=True)
class _Active:
    handle: SendHandle
    start_block: int
    num_blocks: int
    sent: list[int]
    """Per layer: blocks of the prompt sent so far (from block 0)."""
    span: Span = INVALID_SPAN
    """The transfer's span: an event per layer's blocks queued for sending."""


class LayerStreamer:
    def __init__(self, runner: ModelRunner, num_layers: int) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.num_layers = num_layers
        self._active: dict[str, _Active] = {}
        runner.layer_hook = self.on_layer

    def add(self, request_id: str, handle: SendHandle, start_block: int, num_blocks: int,
            span: Span = INVALID_SPAN) -> None:
        """Streams ``num_blocks`` prompt blocks from ``start_block`` on (``span``: the transfer's)."""
        self._active[request_id] = _Active(handle, start_block, num_blocks, [start_block] * self.num_layers, span)

    def remove(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def on_layer(self, layer: int) -> None:
        bs = self.block_size
        for sl in self.runner.step_slices:
            a = self._active.get(sl.request_id)
            if a is None:
                continue
            upto = blocks_for(sl.end, bs) if sl.end >= sl.num_prompt_tokens else sl.end // bs
            upto = min(upto, a.start_block + a.num_blocks)
            lo = a.sent[layer]
            if upto > lo:
                a.handle.send_layer(layer, sl.block_table[lo:upto], lo - a.start_block)
                a.sent[layer] = upto
                if a.span.is_recording():
                    a.span.add_event("layer", {"kvrelay.layer": layer, "kvrelay.kv.blocks": upto - lo})
