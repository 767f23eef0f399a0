"""Rotary position embeddings (Hugging Face's rotate-half convention), with
the default, linear and Llama 3 frequency schemes."""

from __future__ import annotations

import math

import torch

from kvrelay.engine.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies ``[head_dim // 2]`` in fp32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (rope.theta ** exponent)
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions ``[0, max_positions)``."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int,
                 dtype: torch.dtype, device: str) -> None:
        inv = inv_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)
        self.half = head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions``, shaped ``[N, 1, head_dim]`` (shared by q and k)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` of shape ``[N, heads, head_dim]``."""
        x1, x2 = x[..., :self.half], x[..., self.half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin
