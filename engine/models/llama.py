"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) as plain tensors and
functions: no nn.Module dispatch on the hot path. q/k/v and gate/up
projections are fused into one matmul each at load time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrelay.engine.checkpoint import Checkpoint
from kvrelay.engine.config import ModelConfig
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.layers.attention import AttentionMetadata, paged_attention
from kvrelay.engine.layers.linear import Linear
from kvrelay.engine.layers.rotary import RotaryEmbedding

LayerHook = Callable[[int], None]
"""Called with a layer index once that layer's KV of the step is in the cache."""


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    """``[(H + 2 * H_kv) * D, hidden]`` (+ bias for Qwen2)"""
    o: Linear
    gate_up: Linear
    """``[2 * intermediate, hidden]``"""
    down: Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, as Hugging Face does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Weights and forward pass of one model replica."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str, pack_weights: bool = True) -> None:
        self.cfg = cfg
        self.pack_weights = pack_weights
        self.dtype = dtype
        self.device = device
        self.layers: list[LayerWeights] = []
        self.embed: torch.Tensor
        self.lm_head: Linear
        self.norm: torch.Tensor
        """The weights above are set by :meth:`load` (:meth:`from_checkpoint` builds and loads)."""
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, dtype, device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype, device: str,
                        pack_weights: bool = True) -> LlamaModel:
        model = cls(ckpt.config, dtype, device, pack_weights)
        raw = dict(ckpt.tensors())
        model.load(raw)
        return model

    def load(self, raw: dict[str, torch.Tensor]) -> None:
        cfg = self.cfg

        def t(name: str) -> torch.Tensor:
            return raw[name].to(dtype=self.dtype, device=self.device)

        pack = self.pack_weights
        self.embed = t("model.embed_tokens.weight").contiguous()
        self.lm_head = Linear(self.embed if cfg.tie_word_embeddings else t("lm_head.weight"), pack=pack)
        self.norm = t("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([t(a + "q_proj.bias"), t(a + "k_proj.bias"), t(a + "v_proj.bias")])
            self.layers.append(LayerWeights(
                input_norm=t(p + "input_layernorm.weight"),
                post_norm=t(p + "post_attention_layernorm.weight"),
                qkv=Linear(torch.cat([t(a + "q_proj.weight"), t(a + "k_proj.weight"), t(a + "v_proj.weight")]),
                           bias, pack=pack),
                o=Linear(t(a + "o_proj.weight"), pack=pack),
                gate_up=Linear(torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]), pack=pack),
                down=Linear(t(p + "mlp.down_proj.weight"), pack=pack),
            ))

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (embedding rows excluded)."""
        total = self.lm_head.nbytes() + self.norm.numel() * self.norm.element_size()
        for lw in self.layers:
            total += sum(lin.nbytes() for lin in (lw.qkv, lw.o, lw.gate_up, lw.down))
            total += sum(w.numel() * w.element_size() for w in (lw.input_norm, lw.post_norm))
        return total

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache, hook: LayerHook | None = None) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` after the final norm for a step's tokens."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.tables(positions)
        rot = self.rotary.apply
        inter = cfg.intermediate_size
        for i, lw in enumerate(self.layers):
            h = rms_norm(x, lw.input_norm, eps)
            qkv = lw.qkv(h)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = rot(q.view(n, heads, dim), cos, sin)
            k = rot(k.view(n, kv_heads, dim), cos, sin)
            k_cache, v_cache = cache.layer(i)
            attn = paged_attention(q, k, v.view(n, kv_heads, dim), k_cache, v_cache, meta)
            if hook is not None:
                hook(i)
            x = x + lw.o(attn)
            h = rms_norm(x, lw.post_norm, eps)
            gu = lw.gate_up(h)
            x = x + lw.down(F.silu(gu[:, :inter]) * gu[:, inter:])
        return rms_norm(x, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for selected hidden states."""
        return self.lm_head(hidden).float()
