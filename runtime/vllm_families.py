"""Which of vLLM's KV caches kvrelay's connector moves, decided from vLLM's own
description of a model's cache (its KV cache groups and each group's spec).

The connector (runtime/vllm_connector.py) moves whole pages of one buffer of
equal layers, each page a block of K and V for every KV head: the cache of a
model whose attention layers are all full attention (dense and GQA models,
vLLM's ``FullAttentionSpec``) or all sliding-window attention
(``SlidingWindowSpec``, e.g. Mistral-7B-v0.1: vLLM frees the blocks behind the
window and the connector moves the request's blocks vLLM still holds; tested
token-identical with the prompt computed at the decode worker, at prompts ten
times the window). Anything else is refused when the engine starts, by name,
rather than moved wrongly:

- multi-head latent attention (``MLAAttentionSpec``: DeepSeek-V2/V3, Kimi K2):
  one latent vector a token, no K and V (its pages are another shape);
- chunked local attention on every layer, cross-attention (encoder-decoder
  models), state-space layers (``MambaSpec``: Jamba, Bamba, Qwen3-Next), and
  any spec vLLM adds later;
- several KV cache groups (a hybrid model vLLM keeps apart), or none.

Models that interleave local (sliding-window or chunked) and full attention
(Gemma 2/3, Llama 4) pass: with a connector that lacks vLLM's hybrid-allocator
support vLLM gives their local layers full-attention caches, one group of
``FullAttentionSpec`` (vLLM 0.32 ``unify_hybrid_kv_cache_specs``; the layers
still compute over their window). That is read from vLLM's source, not tested
here.

Pure (no vLLM import): the connector passes the spec class names.
"""

from __future__ import annotations

MOVED = frozenset({"FullAttentionSpec", "SlidingWindowSpec"})
"""The specs (class names, exactly: not subclasses) whose pages the connector moves."""

REFUSED = {
    "MLAAttentionSpec": "multi-head latent attention (MLA, e.g. DeepSeek-V2/V3)",
    "SlidingWindowMLASpec": "sliding-window multi-head latent attention",
    "ChunkedLocalAttentionSpec": "chunked local attention on every layer",
    "CrossAttentionSpec": "cross-attention (an encoder-decoder model)",
    "EncoderOnlyAttentionSpec": "encoder-only attention (no KV cache to move)",
    "MambaSpec": "state-space (Mamba) layers (a hybrid model such as Jamba or Bamba)",
}
"""Specs of vLLM 0.32 refused, with what each is in words (others are named by their class)."""


def refusal(model: str, group_specs: list[str]) -> str | None:
    """Why the connector cannot move ``model``'s KV cache, whose groups have
    specs of these class names (one per group); None when it can."""
    if len(group_specs) == 1 and group_specs[0] in MOVED:
        return None
    kinds = sorted({REFUSED.get(s, f"vLLM's {s}") for s in group_specs if s not in MOVED})
    if not group_specs:
        kinds = ["no KV cache group (no attention layer)"]
    elif not kinds:  # several groups, each of a kind moved alone
        kinds = [f"{len(group_specs)} separate KV cache groups"]
    return (f"{model}: vLLM's KV cache for this model has {'; '.join(kinds)}; kvrelay's connector moves one KV "
            "cache group of full or sliding-window attention (dense, GQA and sliding-window models): see "
            "engine/VLLM.md")
