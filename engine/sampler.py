"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Randomness for output token ``i`` of a request comes from a generator
seeded with ``mix(seed, i)``, so a seeded request gives the same tokens
alone or batched, after preemption, and on another worker after migration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    """Seed for output token ``index`` of a request seeded with ``seed``."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEEB86659FD3) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK64


@dataclass(slots=True)
class TopLogprobs:
    """The most likely tokens at one position, most likely first."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    seed: int
    index: int
    """Index of the token being sampled among the request's outputs."""


class Sampler:
    def __init__(self) -> None:
        self._gen = torch.Generator(device="cpu")

    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest]
                 ) -> tuple[list[int], list[float] | None, list[TopLogprobs | None] | None]:
        """Picks one token per row of fp32 ``logits [B, vocab]``.

        Returns the token ids; when any row asked for them, the
        log-probabilities of the chosen tokens under the model's distribution
        (``log_softmax`` of the raw logits: before temperature, top-k and
        top-p); and when any row asked for ``top_logprobs``, per row its k most
        likely tokens under that same distribution (None for rows that did not
        ask).
        """
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = self._probs(logits[idx], [rows[i].params for i in random_rows]).cpu()
            for j, i in enumerate(random_rows):
                self._gen.manual_seed(token_seed(rows[i].seed, rows[i].index))
                tokens[i] = torch.multinomial(probs[j], 1, generator=self._gen).item()
        token_list = tokens.tolist()
        logprobs = tops = None
        if any(r.params.logprobs for r in rows):
            lp = torch.log_softmax(logits, dim=-1)
            logprobs = lp.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
            tops = self._top_logprobs(lp, rows)
        return token_list, logprobs, tops

    @staticmethod
    def _top_logprobs(lp: torch.Tensor, rows: list[SampleRequest]) -> list[TopLogprobs | None] | None:
        """Each row's ``top_logprobs`` most likely tokens of ``lp [B, vocab]``, most likely first."""
        k_max = min(max(r.params.top_logprobs for r in rows), lp.shape[-1])
        if k_max <= 0:
            return None
        top = lp.topk(k_max, dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()
        out: list[TopLogprobs | None] = []
        for i, r in enumerate(rows):
            k = r.params.top_logprobs
            out.append(TopLogprobs(ids[i][:k], values[i][:k]) if k > 0 else None)
        return out

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
        logits = logits / temps
        need_k = any(p.top_k > 0 for p in params)
        need_p = any(p.top_p < 1.0 for p in params)
        if need_k or need_p:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            if need_k:
                ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
                ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
                sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
            if need_p:
                ps = torch.tensor([p.top_p for p in params], device=logits.device).unsqueeze(1)
                sp = sorted_logits.softmax(dim=-1)
                cum = sp.cumsum(dim=-1)
                # Keep the smallest prefix whose mass reaches top_p (always the top token).
                drop = (cum - sp) >= ps
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return logits.softmax(dim=-1)
