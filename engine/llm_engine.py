"""The engine: a model, its paged KV cache and a scheduler, stepped by the
caller (a worker's loop, a benchmark or a test).

Lifecycle of a request: ``add_request`` validates and queues it; each
``step`` schedules a batch, runs it, samples, and returns a
:class:`RequestOutput` per request that advanced; a request ends with
``finished=True`` (stop, length) or through ``abort_request``, and its
blocks go back to the pool at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvrelay.engine.block_pool import BlockPool, KVEvents
from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.checkpoint import load_checkpoint
from kvrelay.engine.config import EngineConfig, effective_max_model_len
from kvrelay.engine.errors import InvalidRequestError, OutOfBlocksError
from kvrelay.engine.kv_cache import KVCache, KVLayout, torch_dtype
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.models.llama import LlamaModel
from kvrelay.engine.sampler import Sampler, SampleRequest, TopLogprobs
from kvrelay.engine.sampling_params import SamplingParams, check_request_length
from kvrelay.engine.scheduler import Scheduler, SchedulerOutput
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    """``stop`` (EOS, stop token or stop string), ``length`` or ``abort``."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """One per new token when the request asked for ``top_logprobs`` (empty
    lists for a first token sampled elsewhere whose alternatives are unknown)."""


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    prefix_hit_blocks: int
    prefix_query_blocks: int
    queued_prefill_tokens: int = 0
    """Prompt tokens admitted or waiting but not computed yet."""
    prefill_tokens_per_s: float = 0.0
    """Measured prompt throughput (0 until a prompt was computed)."""
    decode_step_s: float = 0.0
    """Mean time of a decode-only step (0 until one ran)."""


@dataclass(slots=True)
class StepUsage:
    """What one step computed, for the caller's usage accounting (``LLMEngine.step_hook``)."""

    ns: int
    """Wall time of the step (scheduling, model, sampling), in nanoseconds."""
    tokens: list[tuple[object, int]]
    """Per sequence in the step: its ``account`` and the tokens computed for it
    (a prefill chunk's length; 1 for a decoding sequence)."""
    request_ids: list[str] = field(default_factory=list)
    """The sequences' request ids, in the order of ``tokens``."""
    end_unix_ns: int = 0
    """When the step ended (``time.time_ns()``): it began ``ns`` before."""


class LLMEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        ckpt = load_checkpoint(cfg.model_path)
        self.model_config = ckpt.config
        self.tokenizer = Tokenizer(cfg.model_path)
        self.model = LlamaModel.from_checkpoint(ckpt, torch_dtype(cfg.dtype), cfg.device)
        self.layout = KVLayout.for_model(ckpt.config, cfg.dtype, cfg.cache.block_size)
        num_blocks = cfg.cache.num_blocks or KVCache.blocks_for_budget(
            self.layout, int(cfg.cache.memory_gib * 2**30))
        self.cache = KVCache(self.layout, num_blocks, cfg.device, shm_path=cfg.kv_shm_path)
        self.pool = BlockPool(num_blocks, cfg.cache.enable_prefix_caching)
        self.scheduler = Scheduler(cfg.scheduler, self.pool, cfg.cache.block_size)
        self.runner = ModelRunner(self.model, self.cache)
        self.sampler = Sampler()
        self.max_model_len = effective_max_model_len(ckpt.config, cfg.scheduler)
        eos = set(ckpt.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._seqs: dict[str, Sequence] = {}
        self._reserved: dict[str, Sequence] = {}
        """Sequences whose blocks wait for KV computed elsewhere."""
        self._held: dict[str, list[int]] = {}
        """Blocks of finished sequences kept for a transfer, by request id."""
        self._hold: set[str] = set()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._rng = random.Random()
        self.step_hook: Callable[[StepUsage], None] | None = None
        """Called on the stepping thread after every step that ran the model."""

    # -- requests ------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError when the request cannot be served."""
        n = len(prompt_token_ids)
        check_request_length(n, params.max_tokens, self.max_model_len)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        capacity = self.pool.num_blocks * self.layout.block_size
        if n + params.max_tokens > capacity:
            raise InvalidRequestError(f"prompt + max_tokens ({n + params.max_tokens} tokens) exceeds this "
                                      f"worker's KV cache ({capacity} tokens)")

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      salt: str, account: object = None, priority: int = 0) -> Sequence:
        if request_id in self._seqs or request_id in self._held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, salt, account=account, priority=priority)
        self._seqs[request_id] = seq
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop)
        return seq

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    salt: str = "", hold_blocks: bool = False, account: object = None, priority: int = 0) -> None:
        """Queues a request. With ``hold_blocks`` its blocks are kept when it
        finishes (for a KV transfer) until ``release_blocks``. ``account``
        comes back with the request's share of each step (``step_hook``).
        ``priority``: 0 interactive, 1 batch (admitted after every waiting interactive one)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, salt, account, priority)
        if hold_blocks:
            self._hold.add(request_id)
        self.scheduler.add(seq)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                salt: str = "", account: object = None) -> tuple[list[int], int]:
        """Allocates blocks for a prompt whose KV will be computed elsewhere.

        Returns the block table and how many leading blocks this engine's
        prefix cache already holds (those need no transfer). The request
        does not run until ``commit_prefilled``; ``abort_request`` frees it.

        Raises:
            OutOfBlocksError: not enough free blocks now.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, salt, account)
        bs = self.layout.block_size
        n = seq.num_prompt_tokens
        hit = self.pool.match_prefix(seq.hashes_up_to((n - 1) // bs, bs))
        try:
            fresh = self.pool.allocate(blocks_for(n, bs) - len(hit))
        except OutOfBlocksError:
            self.pool.free(hit)
            self._seqs.pop(request_id)
            self._detok.pop(request_id)
            raise
        seq.block_table = hit + fresh
        seq.num_cached_tokens = len(hit) * bs
        self._reserved[request_id] = seq
        return list(seq.block_table), len(hit)

    def commit_prefilled(self, request_id: str, first_token: int, logprob: float | None,
                         top: TopLogprobs | None = None) -> RequestOutput:
        """The reserved request's prompt KV has landed: it joins the running
        batch with ``first_token`` (sampled by the prefill worker) as its first output.
        InvalidRequestError, with the reservation kept (abort frees it), when
        ``first_token`` is outside the vocabulary: it came from the wire."""
        vocab = self.model_config.vocab_size
        if not 0 <= first_token < vocab:
            raise InvalidRequestError(f"first token id {first_token} is outside the vocabulary [0, {vocab})")
        seq = self._reserved.pop(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._register_full_blocks(seq)
        self.scheduler.add_running(seq)
        return self._append_token(seq, first_token, logprob, top)

    def release_blocks(self, request_id: str) -> bool:
        """Frees the blocks a finished ``hold_blocks`` request kept."""
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    def held_blocks(self, request_id: str) -> list[int] | None:
        return self._held.get(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request (queued, running, reserved or held) and frees its
        blocks; False if it is unknown."""
        if self.release_blocks(request_id):
            return True
        seq = self._seqs.pop(request_id, None)
        self._detok.pop(request_id, None)
        self._reserved.pop(request_id, None)
        self._hold.discard(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        """Requests queued or running (reserved and held ones excluded)."""
        return self.scheduler.has_work()

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def num_held(self) -> int:
        return len(self._held)

    # -- stepping ------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter_ns()
        sched = self.scheduler.schedule()
        if not sched:
            return []
        outputs = self._run(sched)
        if self.step_hook is not None:
            entries = sched.entries
            self.step_hook(StepUsage(time.perf_counter_ns() - t0, [(e.seq.account, e.num_new_tokens) for e in entries],
                                     [e.seq.request_id for e in entries], time.time_ns()))
        return outputs

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Runs one scheduled step: the model, the blocks it filled, sampling."""
        logits = self.runner.execute(sched.decode, sched.prefill)
        entries = sched.entries
        for e in entries:
            e.seq.num_computed_tokens += e.num_new_tokens
            self._register_full_blocks(e.seq)
        sampled = [e.seq for e in entries if e.sample]
        if not sampled:
            return []
        rows = [self._sample_request(s) for s in sampled]
        tokens, logprobs, tops = self.sampler(logits, rows)
        outputs = []
        for i, seq in enumerate(sampled):
            outputs.append(self._append_token(seq, tokens[i], None if logprobs is None else logprobs[i],
                                              None if tops is None else tops[i]))
        return outputs

    def _sample_request(self, seq: Sequence) -> SampleRequest:
        """What the sampler needs of ``seq`` for its next token."""
        p, index = seq.params, seq.num_generated
        stops: frozenset[int] = frozenset()
        if index < p.min_tokens:  # only then: this runs for every sequence at every step
            stops = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        return SampleRequest(p, seq.seed, index, seq.prompt_token_ids, seq.output_token_ids, stops)

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.layout.block_size
        full = seq.num_computed_tokens // bs
        if full > seq.num_registered_blocks:
            hashes = seq.hashes_up_to(full, bs)
            for j in range(seq.num_registered_blocks, full):
                self.pool.cache_block(seq.block_table[j], hashes[j])
            seq.num_registered_blocks = full

    def _append_token(self, seq: Sequence, token: int, logprob: float | None,
                      top: TopLogprobs | None = None) -> RequestOutput:
        params = seq.params
        seq.output_token_ids.append(token)
        if logprob is not None and params.logprobs:
            seq.output_logprobs.append(logprob)
        detok = self._detok[seq.request_id]
        reason = None
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            reason = "stop"
        else:
            detok.add(token, check_stop=seq.num_generated >= params.min_tokens)
            if detok.stopped:
                reason = "stop"
            elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            hold = seq.request_id in self._hold
            self.scheduler.finish(seq, reason, free_blocks=not hold)
            if hold:
                self._hold.discard(seq.request_id)
                self._held[seq.request_id] = seq.block_table
                seq.block_table = []
            self._seqs.pop(seq.request_id, None)
            self._detok.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=[token], new_text=detok.take(final=reason is not None),
            finished=reason is not None, finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=[logprob] if (logprob is not None and params.logprobs) else [],
            new_top_logprobs=[top or TopLogprobs([], [])] if params.top_logprobs else [])

    # -- convenience ---------------------------------------------------------
    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams],
                 deadline_s: float = 600.0, salts: list[str] | None = None) -> list[CompletedRequest]:
        """Runs prompts to completion (offline use, tests, benchmarks); ``salts``
        (one per prompt) scope their prefix-cache hits as a tenant's salt does."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        slist = salts if salts is not None else [""] * len(prompts)
        if len(slist) != len(prompts):
            raise ValueError(f"generate got {len(slist)} salts for {len(prompts)} prompts")
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        done: dict[str, CompletedRequest] = {i: CompletedRequest(i) for i in ids}
        for rid, p, sp, salt in zip(ids, prompts, plist, slist):
            self.add_request(rid, p, sp, salt=salt)
        end = time.monotonic() + deadline_s
        while any(not c.finished for c in done.values()):
            if time.monotonic() > end:
                for rid in ids:
                    self.abort_request(rid)
                raise TimeoutError(f"generate did not finish within {deadline_s} s")
            for out in self.step():
                c = done[out.request_id]
                c.token_ids += out.new_token_ids
                c.text += out.new_text
                c.logprobs += out.new_logprobs
                c.top_logprobs += out.new_top_logprobs
                c.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    c.finished, c.finish_reason = True, out.finish_reason
        return [done[i] for i in ids]

    @torch.inference_mode()
    def prompt_logits(self, prompt_token_ids: list[int], salt: str = "") -> tuple[torch.Tensor, int]:
        """fp32 logits of every prompt position the engine computes (those
        after the cached prefix), and the number of cached tokens. Runs on an
        idle engine, through the same scheduler, chunking and prefix cache as
        ``step``; the prompt's full blocks stay cached afterwards."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine")
        params = SamplingParams(max_tokens=1)
        self.validate(prompt_token_ids, params)
        seq = Sequence(f"logits-{time.monotonic_ns()}", list(prompt_token_ids), params, 0, salt)
        self.scheduler.add(seq)
        chunks = []
        try:
            while seq.num_computed_tokens < seq.num_tokens:
                sched = self.scheduler.schedule()
                chunks.append(self.runner.execute(sched.decode, sched.prefill, all_logits=True))
                for e in sched.entries:
                    e.seq.num_computed_tokens += e.num_new_tokens
                    self._register_full_blocks(e.seq)
        finally:
            self.scheduler.finish(seq, "abort")
        return torch.cat(chunks), seq.num_cached_tokens

    def stats(self) -> EngineStats:
        r = self.runner
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.pool.num_free, num_blocks=self.pool.num_blocks,
            num_prefill_tokens=self.runner.num_prefill_tokens, num_decode_tokens=self.runner.num_decode_tokens,
            num_preemptions=self.scheduler.num_preemptions, prefix_hit_blocks=self.pool.prefix_hits,
            prefix_query_blocks=self.pool.prefix_queries,
            queued_prefill_tokens=sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                                      for s in (*self.scheduler.waiting, *self.scheduler.running)),
            prefill_tokens_per_s=(r.num_prefill_tokens / r.prefill_seconds if r.prefill_seconds else 0.0),
            decode_step_s=(r.decode_seconds / r.decode_steps if r.decode_steps else 0.0))

    def drain_kv_events(self, snapshot: bool = False) -> KVEvents:
        """Prefix-cache changes since the last call, for the router's index;
        with ``snapshot``, every cached hash as ``stored`` (and the pending
        changes dropped), to resynchronise an index that missed some."""
        ev = self.pool.drain_events()
        if snapshot:
            return KVEvents(stored=self.pool.cached_hashes(), removed=[])
        return ev

    def sequence(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)


@dataclass(slots=True)
class CompletedRequest:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0


__all__ = ["CompletedRequest", "EngineStats", "LLMEngine", "RequestOutput", "SequenceStatus", "StepUsage"]
