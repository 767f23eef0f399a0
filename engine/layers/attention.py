"""Paged attention in plain torch (CPU and CUDA).

A step's tokens are laid out as ``[decode tokens | prefill chunk tokens]``.
Decode tokens (one per sequence) attend over their sequence's blocks in one
batched SDPA call with a padding mask; each prefill chunk attends over its
cached prefix (gathered from the blocks) plus itself, causally. New K/V are
written into the cache before attention, so a chunk reads its own keys from
the same place as later steps will.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    """One sequence's prefill chunk inside a step."""

    token_start: int
    """Index of the chunk's first token in the step's token array."""
    num_tokens: int
    context_start: int
    """Tokens of this sequence already in the cache before the chunk."""
    block_table: torch.Tensor
    """Blocks covering ``context_start + num_tokens`` tokens (long tensor)."""
    mask: torch.Tensor | None
    """``[1, 1, num_tokens, context]`` bool, or ``None`` for a plain causal chunk."""


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each one attends to."""

    slot_mapping: torch.Tensor
    """Cache slot (``block * block_size + offset``) of every token of the step."""
    num_decode: int
    decode_block_tables: torch.Tensor | None = None
    """``[num_decode, max_blocks]`` padded block tables."""
    decode_mask: torch.Tensor | None = None
    """``[num_decode, 1, 1, max_blocks * block_size]`` bool: key is visible."""
    prefills: list[PrefillSegment] = field(default_factory=list)


def build_decode_mask(context_lens: list[int], max_len: int, window: int | None,
                      device: str) -> torch.Tensor:
    lens = torch.tensor(context_lens, device=device).unsqueeze(1)
    keys = torch.arange(max_len, device=device).unsqueeze(0)
    mask = keys < lens
    if window is not None:
        mask &= keys > lens - 1 - window
    return mask[:, None, None, :]


def build_prefill_mask(context_start: int, num_tokens: int, window: int | None,
                       device: str) -> torch.Tensor | None:
    """Causal mask of a chunk that follows ``context_start`` cached tokens;
    ``None`` when plain ``is_causal`` attention is exact."""
    if context_start == 0 and window is None:
        return None
    q_pos = torch.arange(context_start, context_start + num_tokens, device=device).unsqueeze(1)
    k_pos = torch.arange(context_start + num_tokens, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask[None, None]


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Copies the blocks named by ``table`` (any shape) out of one layer's
    ``[num_blocks, ...]`` cache, as ``[table.numel(), block elements]``.
    index_select on a 2-D view is several times faster than advanced indexing."""
    return torch.index_select(cache.view(cache.shape[0], -1), 0, table.reshape(-1))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """Attention for a step.

    Args:
        q: ``[N, num_heads, head_dim]``; k, v: ``[N, num_kv_heads, head_dim]``.
        k_cache, v_cache: one layer's ``[num_blocks, block_size, H_kv, D]``.
        meta: the step's layout.
    Returns:
        ``[N, num_heads * head_dim]``.
    """
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty(n, heads, dim, dtype=q.dtype, device=q.device)
    gqa = kv_heads != heads
    nd = meta.num_decode
    if nd:
        tables = meta.decode_block_tables
        if tables is None:
            raise ValueError(f"attention metadata with {nd} decode tokens has no decode_block_tables")
        kd = gather_blocks(k_cache, tables).view(nd, -1, kv_heads, dim).transpose(1, 2)
        vd = gather_blocks(v_cache, tables).view(nd, -1, kv_heads, dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kd, vd,
                                            attn_mask=meta.decode_mask, enable_gqa=gqa)
        out[:nd] = od.squeeze(2)
    for seg in meta.prefills:
        s, t = seg.token_start, seg.num_tokens
        qs = q[s:s + t].transpose(0, 1).unsqueeze(0)
        if seg.context_start == 0:
            ks, vs = k[s:s + t], v[s:s + t]
        else:
            ctx = seg.context_start + t
            ks = gather_blocks(k_cache, seg.block_table).view(-1, kv_heads, dim)[:ctx]
            vs = gather_blocks(v_cache, seg.block_table).view(-1, kv_heads, dim)[:ctx]
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        if seg.mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, enable_gqa=gqa)
        out[s:s + t] = o.squeeze(0).transpose(0, 1)
    return out.view(n, heads * dim)
