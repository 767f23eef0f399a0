"""What a KV codec costs in answers (issue 35, item 4): a prompt's KV is
computed, passed through the codec in the cache (encoded and decoded in place,
as a receiver lands it), and the model then continues from it, as a decode
worker continues from KV that crossed a link under that codec.

- ``perplexity``: of a suffix (``suffix_tokens``) after a prefix
  (``prefix_tokens``, whole blocks) whose KV went through the codec, against
  the same with the prefix's KV untouched, over ``windows`` windows of real
  text that ships with Python itself (the prose of its ``pydoc_data`` topics:
  not text the model wrote);
- ``top1_agreement``: the fraction of those suffix positions whose most likely
  next token is the same as without the codec;
- ``greedy_agreement``: the fraction of ``prompts`` prompts (a prefix of whole
  blocks and one more token) whose first ``greedy_tokens`` greedy tokens are
  identical to those without the codec.

A ``bf16_rounding`` row passes the KV through bfloat16 and back: on an fp32
engine, the floor any bf16 deployment already pays, to read the codecs' rows
against. The suffix's own KV is computed at the decode side and stays exact, as in a
disaggregated request. Each codec runs under its own salt, so no codec reads
blocks another left in the prefix cache. ``kvrelay bench kv-codec`` prints
this with the codecs' speed (benchmarks/codec_bench.py). JSON field names are
stable."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F

from kvrelay.engine.config import CacheConfig, DType, EngineConfig, SchedulerConfig
from kvrelay.engine.hashing import hash_blocks
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.base import KVCodec
from kvrelay.kvtransfer.codecs import decode, encode

BLOCK_SIZE = 16


@dataclass(slots=True, frozen=True)
class QualitySetup:
    """How much text each measurement reads (defaults: issue 35's figures)."""

    prefix_tokens: int = 256
    """Tokens whose KV goes through the codec (a multiple of 16: whole blocks)."""
    suffix_tokens: int = 256
    """Tokens scored after the prefix, per window."""
    windows: int = 8
    """Perplexity windows, spread evenly over the text."""
    prompts: int = 32
    """Greedy prompts, spread evenly over the text."""
    greedy_tokens: int = 32
    """Greedy tokens compared per prompt."""

    def check(self) -> None:
        if self.prefix_tokens < BLOCK_SIZE or self.prefix_tokens % BLOCK_SIZE:
            raise ValueError(f"prefix_tokens must be a positive multiple of {BLOCK_SIZE}, got {self.prefix_tokens}")
        for name in ("suffix_tokens", "windows", "prompts", "greedy_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def corpus(tokenizer) -> list[int]:
    """The prose lines of Python's own documentation topics, tokenized."""
    lines = [line for text in topics.values() for line in text.splitlines()
             if len(line) > 40 and not line[0].isspace() and not line.startswith(("*", "=", "-"))]
    return tokenizer.encode("\n".join(lines), add_special_tokens=False)


def _windows(tokens: list[int], n: int, length: int) -> list[list[int]]:
    if len(tokens) < n * length:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than {n} windows of {length}")
    step = len(tokens) // n
    return [tokens[i * step:i * step + length] for i in range(n)]


Transform = Callable[[torch.Tensor], torch.Tensor] | None
"""What a prefix's KV goes through in place (None: nothing)."""


def codec_transform(codec: KVCodec) -> Transform:
    """A codec's round trip, as a receiver lands what the sender encoded."""
    if codec is KVCodec.NONE:
        return None
    return lambda x: decode(encode(codec, x), x.dtype)


def bf16_rounding(x: torch.Tensor) -> torch.Tensor:
    """The KV rounded to bfloat16 and back: what a bf16 cache (vLLM's default dtype) does to an fp32 one."""
    return x.to(torch.bfloat16).to(x.dtype)


def _pass_prefix(eng: LLMEngine, prefix: list[int], salt: str, transform: Transform) -> None:
    """Computes ``prefix``'s KV into the prefix cache, then passes its blocks through ``transform`` in place."""
    eng.prompt_logits(prefix, salt)
    if transform is None:
        return
    hashes = hash_blocks(prefix, BLOCK_SIZE, salt)
    ids = eng.pool.match_prefix(hashes)  # a reference, only to read the ids; given back at once
    eng.pool.free(ids)
    if len(ids) != len(hashes):
        raise RuntimeError(f"the prefix's {len(hashes)} blocks are not all cached ({len(ids)} are)")
    idx = torch.tensor(ids, device=eng.cache.kv.device)
    for layer in range(eng.layout.num_layers):
        for plane in eng.cache.layer(layer):
            plane[idx] = transform(plane[idx])


def window_scores(eng: LLMEngine, window: list[int], prefix_tokens: int, transform: Transform,
                  salt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL of the window's tokens after its first ``prefix_tokens + 1``, and the most likely
    token at each of those positions, the prefix's KV through ``transform``."""
    _pass_prefix(eng, window[:prefix_tokens], salt, transform)
    logits, cached = eng.prompt_logits(window, salt)
    if cached != prefix_tokens:
        raise RuntimeError(f"the window reused {cached} cached tokens, not its {prefix_tokens}-token prefix")
    scored = logits[:-1].float()
    return F.cross_entropy(scored, torch.tensor(window[cached + 1:]), reduction="none"), scored.argmax(-1)


def greedy(eng: LLMEngine, prompts: list[list[int]], prefix_tokens: int, transform: Transform, tag: str,
           n: int) -> list[list[int]]:
    """The first ``n`` greedy tokens of each prompt, its first ``prefix_tokens`` KV through ``transform``."""
    salts = [f"{tag}-{i}" for i in range(len(prompts))]
    for p, salt in zip(prompts, salts):
        _pass_prefix(eng, p[:prefix_tokens], salt, transform)
    outs = eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), salts=salts)
    if any(o.num_cached_tokens != prefix_tokens for o in outs):
        raise RuntimeError(f"a greedy prompt did not start from its {prefix_tokens} passed tokens")
    return [o.token_ids for o in outs]


def _codec_rows(eng: LLMEngine, setup: QualitySetup, windows: list[list[int]], prompts: list[list[int]],
                codecs: tuple[KVCodec, ...]) -> dict[str, dict]:
    base: tuple[torch.Tensor, torch.Tensor, list[list[int]]] | None = None
    rows: dict[str, dict] = {}
    passes: list[tuple[str, Transform]] = [("none", None), ("bf16_rounding", bf16_rounding)]
    passes += [(c.value, codec_transform(c)) for c in codecs]
    for name, transform in passes:
        scores = [window_scores(eng, w, setup.prefix_tokens, transform, f"{name}-w{i}")
                  for i, w in enumerate(windows)]
        nll, top1 = torch.cat([s[0] for s in scores]), torch.cat([s[1] for s in scores])
        toks = greedy(eng, prompts, setup.prefix_tokens, transform, f"{name}-g", setup.greedy_tokens)
        if base is None:
            base = (nll, top1, toks)
        ppl, base_ppl = math.exp(nll.mean().item()), math.exp(base[0].mean().item())
        rows[name] = {
            "perplexity": ppl, "perplexity_delta_pct": (ppl / base_ppl - 1.0) * 100.0,
            "top1_agreement": (top1 == base[1]).float().mean().item(),
            "greedy_agreement": sum(a == b for a, b in zip(toks, base[2])) / len(toks)}
    return rows


def run(model: Path, setup: QualitySetup, codecs: tuple[KVCodec, ...] = (KVCodec.INT8, KVCodec.FP8, KVCodec.INT4),
        dtype: DType = "float32") -> dict:
    """Perplexity, top-1 and greedy agreement of each codec (and of bf16 rounding) against none, on ``model``."""
    setup.check()
    per_prompt = -(-(setup.prefix_tokens + 1 + setup.greedy_tokens) // BLOCK_SIZE)
    window_blocks = -(-(setup.prefix_tokens + setup.suffix_tokens) // BLOCK_SIZE)
    eng = LLMEngine(EngineConfig(
        model_path=model, dtype=dtype, device="cpu",
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=max(setup.prompts * per_prompt, window_blocks) * 2,
                          enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(setup.prompts, 1))))
    text = corpus(eng.tokenizer)
    windows = _windows(text, setup.windows, setup.prefix_tokens + setup.suffix_tokens)
    prompts = _windows(text[len(text) // (2 * setup.prompts):], setup.prompts, setup.prefix_tokens + 1)
    return {"model": model.name, "dtype": dtype, "prefix_tokens": setup.prefix_tokens,
            "suffix_tokens": setup.suffix_tokens, "windows": setup.windows, "prompts": setup.prompts,
            "greedy_tokens": setup.greedy_tokens, "text": "python pydoc_data topics (prose lines)",
            "codecs": _codec_rows(eng, setup, windows, prompts, codecs)}
