"""Continuous batching with a token budget, chunked prefill and preemption.

Each step spends at most ``max_num_batched_tokens``: first on the running
sequences (one token each when decoding, the next chunk when a long prompt
is still being prefilled), then on waiting sequences, whose prompts may be
split across steps. When the pool cannot supply a block, the newest running
sequence is preempted: its blocks are freed (its full blocks stay in the
prefix cache) and it goes back to the head of the queue to be recomputed.
A sequence never touches blocks it does not hold. Waiting sequences queue
by priority (interactive before batch, then arrival), and a step that
admits an interactive prompt admits no batch prompt with it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    sample: bool
    """True when this step reaches the sequence's last known token, so a new
    token is sampled (a decode step, or the last chunk of a prefill)."""


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: decode entries (one token each) before prefill chunks."""

    decode: list[ScheduledSeq] = field(default_factory=list)
    prefill: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def entries(self) -> list[ScheduledSeq]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.decode) + sum(e.num_new_tokens for e in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    """Decides, step by step, which tokens of which sequences to compute."""

    def __init__(self, cfg: SchedulerConfig, pool: BlockPool, block_size: int) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queues ``seq`` after every waiting sequence of its priority or a more urgent one."""
        for i in range(len(self.waiting) - 1, -1, -1):
            if self.waiting[i].priority <= seq.priority:
                self.waiting.insert(i + 1, seq)
                return
        self.waiting.appendleft(seq) if self.waiting else self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_computed_tokens + num_new
        return max(0, blocks_for(total, self.block_size) - len(seq.block_table))

    def _grow(self, seq: Sequence, num_new: int) -> None:
        need = self._blocks_needed(seq, num_new)
        if need:
            seq.block_table.extend(self.pool.allocate(need))

    def _preempt(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        queue = deque(self.running)
        self.running = []
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while self._blocks_needed(seq, n) > self.pool.num_free:
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:
                continue
            self._grow(seq, n)
            self._emit(out, seq, n)
            self.running.append(seq)
            budget -= n
        self.running.extend(queue)
        if not out.preempted:
            budget = self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admits waiting sequences in order while budget, seats and blocks last.
        A step that admits an interactive prompt (priority 0) admits no batch
        one: its first token then waits for its own tokens only."""
        bs = self.block_size
        urgent = bool(self.waiting) and self.waiting[0].priority == 0
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if urgent and seq.priority > 0:
                break
            if not seq.block_table:
                # Leave at least one token to compute, so the step yields logits.
                cacheable = (seq.num_tokens - 1) // bs
                hit = self.pool.match_prefix(seq.hashes_up_to(cacheable, bs))
                seq.block_table = hit
                seq.num_computed_tokens = len(hit) * bs
                seq.num_registered_blocks = len(hit)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._blocks_needed(seq, n) > self.pool.num_free:
                # Wait for running sequences to free blocks; hold nothing meanwhile.
                self.pool.free(seq.block_table)
                seq.block_table = []
                seq.num_computed_tokens = 0
                seq.num_registered_blocks = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._grow(seq, n)
            self._emit(out, seq, n)
            self.running.append(seq)
            budget -= n
        return budget

    @staticmethod
    def _emit(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        sample = seq.num_computed_tokens + n == seq.num_tokens
        entry = ScheduledSeq(seq, n, sample)
        if n == 1 and seq.num_computed_tokens > 0:
            out.decode.append(entry)
        else:
            out.prefill.append(entry)

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """Ends a sequence (any state). Its blocks go back to the pool unless
        ``free_blocks`` is False (the caller then owns ``seq.block_table``)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free_blocks:
            self.pool.free(seq.block_table)
            seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def add_running(self, seq: Sequence) -> None:
        """Joins a sequence whose KV is already in its blocks (received from a
        prefill worker) to the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
