"""Turns a scheduled step into tensors, runs the model over the paged KV
cache, and returns logits for the tokens to sample."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.layers.attention import (
    AttentionMetadata,
    PrefillSegment,
    build_decode_mask,
    build_prefill_mask,
)
from kvrelay.engine.models.llama import LayerHook, LlamaModel
from kvrelay.engine.scheduler import ScheduledSeq


@dataclass(slots=True, frozen=True)
class StepSlice:
    """One prefill chunk of the running step, for layer hooks."""

    request_id: str
    start: int
    """First token position computed in this step."""
    end: int
    """One past the last position computed in this step."""
    num_prompt_tokens: int
    block_table: list[int]


class ModelRunner:
    """Runs steps of one model over one KV cache.

    ``layer_hook`` (optional) is called with each layer index as soon as that
    layer's KV of the step is written; ``step_slices`` then describes the
    step's prefill chunks. The transfer layer streams from it.
    """

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.layout.block_size
        self.device = model.device
        self.layer_hook: LayerHook | None = None
        self.step_slices: list[StepSlice] = []
        self.num_prefill_tokens = 0
        """Prompt (or recomputed) tokens computed by this runner since start."""
        self.num_decode_tokens = 0
        self.prefill_seconds = 0.0
        """Wall time of steps that computed prompt tokens (for the router's cost model)."""
        self.decode_seconds = 0.0
        self.decode_steps = 0

    def prepare(self, decode: list[ScheduledSeq], prefill: list[ScheduledSeq]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Input ids, positions, attention metadata and the indices of the
        tokens whose logits are needed (one per sampling entry, in order)."""
        bs = self.block_size
        window = self.model.cfg.sliding_window
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        tables: list[list[int]] = []
        ctx_lens: list[int] = []
        for i, e in enumerate(decode):
            s = e.seq
            p = s.num_computed_tokens
            ids.append(s.token_at(p))
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
            tables.append(s.block_table)
            ctx_lens.append(p + 1)
            if e.sample:
                sample_idx.append(i)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode=len(decode))
        if decode:
            max_blocks = max(len(t) for t in tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=self.device)
            meta.decode_mask = build_decode_mask(ctx_lens, max_blocks * bs, window, self.device)
        for e in prefill:
            s, n = e.seq, e.num_new_tokens
            start = s.num_computed_tokens
            token_start = len(ids)
            ids.extend(s.tokens(start, start + n))
            pos.extend(range(start, start + n))
            table = s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if e.sample:
                sample_idx.append(token_start + n - 1)
            nblocks = blocks_for(start + n, bs)
            meta.prefills.append(PrefillSegment(
                token_start=token_start, num_tokens=n, context_start=start,
                block_table=torch.tensor(table[:nblocks], dtype=torch.long, device=self.device),
                mask=build_prefill_mask(start, n, window, self.device)))
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return input_ids, positions, meta, sample_idx

    def execute(self, decode: list[ScheduledSeq], prefill: list[ScheduledSeq],
                all_logits: bool = False) -> torch.Tensor:
        """Runs one step; returns fp32 logits of the sampling entries
        (``[num_samples, vocab]``), or of every token when ``all_logits``."""
        input_ids, positions, meta, sample_idx = self.prepare(decode, prefill)
        if self.layer_hook is not None:
            self.step_slices = [StepSlice(e.seq.request_id, e.seq.num_computed_tokens,
                                          e.seq.num_computed_tokens + e.num_new_tokens, e.seq.num_prompt_tokens,
                                          e.seq.block_table) for e in prefill]
        t0 = time.perf_counter()
        hidden = self.model.forward(input_ids, positions, meta, self.cache, self.layer_hook)
        self.num_decode_tokens += len(decode)
        self.num_prefill_tokens += sum(e.num_new_tokens for e in prefill)
        if not all_logits:
            hidden = hidden[torch.tensor(sample_idx, dtype=torch.long, device=self.device)]
        logits = self.model.logits(hidden)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        dt = time.perf_counter() - t0
        if prefill:  # a mixed step counts as prefill: its cost is dominated by the prompt tokens
            self.prefill_seconds += dt
        else:
            self.decode_seconds += dt
            self.decode_steps += 1
        return logits
