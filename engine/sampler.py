"""Token sampling: penalties and min_tokens on the logits, then greedy or
temperature, min-p, top-k and top-p, with per-request seeds.

Randomness for output token ``i`` of a request comes from a generator
seeded with ``mix(seed, i)``, so a seeded request gives the same tokens
alone or batched, after preemption, and on another worker after migration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    """Index of the token being sampled among the request's outputs (an earlier
    attempt's included: ``params.prior_output_tokens``)."""
    prompt: Sequence[int] = ()
    """The request's prompt (its last ``params.prior_output_tokens`` are output)."""
    output: Sequence[int] = ()
    """What this attempt has generated so far."""
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    """What ``min_tokens`` keeps from being sampled: EOS (unless ignored) and ``stop_token_ids``."""

    def output_ids(self) -> list[int]:
        """Every token the request has generated, earlier attempts' included."""
        prior = self.params.prior_output_tokens
        return [*(self.prompt[len(self.prompt) - prior:] if prior else ()), *self.output]


class Sampler:
    def __init__(self) -> None:
        self._gen = torch.Generator(device="cpu")

    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest]
                 ) -> tuple[list[int], list[float] | None, list[TopLogprobs | None] | None]:
        """Picks one token per row of fp32 ``logits [B, vocab]``.

        Returns the token ids; when any row asked for them, the
        log-probabilities of the chosen tokens under the model's distribution
        (``log_softmax`` of the raw logits: before penalties, temperature,
        min-p, top-k and top-p, as vLLM's default ``raw_logprobs``); and when
        any row asked for ``top_logprobs``, per row its k most likely tokens
        under that same distribution (None for rows that did not ask).
        """
        raw = logits.float()
        logits = self._adjust(raw, rows)
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
            lp = torch.log_softmax(raw, dim=-1)
            logprobs = lp.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
            tops = self._top_logprobs(lp, rows)
        return token_list, logprobs, tops

    @staticmethod
    def _adjust(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """``logits`` after each row's penalties and ``min_tokens`` (a copy; the
        same tensor when no row has either)."""
        todo = [i for i, r in enumerate(rows) if r.params.penalized or (r.index < r.params.min_tokens and r.stop_ids)]
        if not todo:
            return logits
        logits = logits.clone()
        vocab, dev = logits.shape[-1], logits.device
        for i in todo:
            r, p, row = rows[i], rows[i].params, logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor([*r.prompt, *r.output], dtype=torch.long, device=dev).unique()
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = torch.tensor(r.output_ids(), dtype=torch.long, device=dev)
                counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            if r.index < p.min_tokens and (stops := sorted(t for t in r.stop_ids if t < vocab)):
                row[torch.tensor(stops, dtype=torch.long, device=dev)] = float("-inf")
        return logits

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
        if any(p.min_p > 0.0 for p in params):
            probs = logits.softmax(dim=-1)
            floor = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
            logits = logits.masked_fill(probs < floor * probs.amax(dim=-1, keepdim=True), float("-inf"))
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
