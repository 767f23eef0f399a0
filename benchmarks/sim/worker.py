"""A simulated worker: kvrelay's own engine scheduler and block pool
(engine/scheduler.py, engine/block_pool.py: continuous batching, chunked
prefill, prefix caching, preemption) with the model replaced by a
profile's step time.

Sequences carry their request's block-hash chain instead of token ids, so
prefix caching, the router's prefix index and placement see exactly the
reuse the trace describes (Mooncake hash_ids) without tokenising anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.benchmarks.sim.clock import Clock
from kvrelay.benchmarks.sim.profile import Profile, attention_pairs
from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.errors import OutOfBlocksError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import Scheduler, SchedulerOutput
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.router.placement.place import WorkerView
from kvrelay.runtime.roles import Role

HASH_MASK = (1 << 64) - 1
"""Block hashes are 64-bit, as the engine's."""


class HashChain:
    """A request's chained block hashes: the prompt's (given) then its output's."""

    __slots__ = ("hashes", "uid")

    def __init__(self, uid: int, prompt_hashes: list[int]) -> None:
        self.uid, self.hashes = uid, prompt_hashes

    def upto(self, n: int) -> list[int]:
        hs = self.hashes
        while len(hs) < n:
            hs.append(hash((hs[-1] if hs else 0, self.uid, len(hs))) & HASH_MASK)
        return hs[:n]


@dataclass(slots=True)
class SimSequence(Sequence):
    """An engine sequence whose block hashes come from its request's chain."""

    chain: HashChain | None = None

    def hashes_up_to(self, num_blocks: int, block_size: int) -> list[int]:
        if num_blocks > len(self.block_hashes):
            if self.chain is None:  # new_sequence gives every one its chain
                raise RuntimeError(f"sequence {self.request_id} has no hash chain")
            self.block_hashes = self.chain.upto(num_blocks)
        return self.block_hashes[:num_blocks]


def new_sequence(rid: str, prompt_tokens: int, max_tokens: int, chain: HashChain, priority: int = 0) -> SimSequence:
    return SimSequence(rid, range(prompt_tokens),  # type: ignore[arg-type]  # a range: only its length is read
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, priority=priority, chain=chain)


@dataclass(slots=True)
class Hooks:
    """What a worker tells the cluster."""

    step_started: Callable[[SimWorker, SchedulerOutput, float], None]
    token: Callable[[SimWorker, Sequence, bool], None]
    """A sequence sampled a token (True: its last)."""
    freed: Callable[[SimWorker], None]
    """Blocks or seats were freed (waiting requests may fit now)."""
    kv_events: Callable[[SimWorker, list[int], list[int]], None]
    """Block hashes stored in and removed from its prefix cache (for the router's index)."""


@dataclass(slots=True)
class Usage:
    """What a worker did, for the report."""

    busy_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    kv_block_s: float = 0.0
    """Integral of used blocks over time."""
    kv_max: float = 0.0
    last_t: float = 0.0


class SimWorker:
    def __init__(self, view: WorkerView, clock: Clock, profile: Profile, num_blocks: int, block_size: int,
                 sched: SchedulerConfig, hooks: Hooks) -> None:
        self.view, self.clock, self.profile, self.hooks = view, clock, profile, hooks
        self.pool = BlockPool(num_blocks)
        self.sched = Scheduler(SchedulerConfig(sched.max_num_batched_tokens, sched.max_num_seqs), self.pool,
                               block_size)
        self.block_size = block_size
        self.busy = False
        self.alive = True
        self.usage = Usage()
        self.held: dict[str, list[int]] = {}
        """Blocks kept after a prefill until its transfer ends (prefill) or reserved for one (decode)."""
        self._generation = 0

    @property
    def wid(self) -> str:
        return self.view.worker_id

    # -- requests --------------------------------------------------------
    def add(self, seq: SimSequence) -> None:
        self.sched.add(seq)
        self.refresh()
        self.kick()

    def reserve(self, seq: SimSequence) -> int | None:
        """Blocks for a prompt computed elsewhere (engine.reserve); the
        leading blocks already cached here, or None when they do not fit."""
        n, bs = seq.num_prompt_tokens, self.block_size
        hit = self.pool.match_prefix(seq.hashes_up_to((n - 1) // bs, bs))
        try:
            fresh = self.pool.allocate(blocks_for(n, bs) - len(hit))
        except OutOfBlocksError:
            self.pool.free(hit)
            return None
        seq.block_table = hit + fresh
        seq.num_cached_tokens = len(hit) * bs
        self.refresh()
        return len(hit)

    def commit(self, seq: SimSequence) -> None:
        """The reserved prompt's KV landed (engine.commit_prefilled): it decodes from here."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._register(seq)
        self.sched.add_running(seq)
        seq.output_token_ids.append(0)
        last = len(seq.output_token_ids) >= seq.params.max_tokens
        if last:
            self.sched.finish(seq, "length")
        self.hooks.token(self, seq, last)
        self.refresh()
        self.kick()

    def release(self, seq: SimSequence) -> None:
        """Ends ``seq`` here (finished elsewhere, aborted or migrated) and frees its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            self.pool.free(seq.block_table)
        elif seq in self.sched.running or seq in self.sched.waiting:
            self.sched.finish(seq, "abort")
        else:  # reserved, not yet running
            self.pool.free(seq.block_table)
            seq.status = SequenceStatus.FINISHED
        seq.block_table = []
        self.refresh()
        self.hooks.freed(self)
        self.kick()

    def die(self) -> list[Sequence]:
        """The worker is gone: nothing it held survives; returns what it was running."""
        self.alive = False
        self.view.healthy = False
        self._generation += 1
        self.busy = False
        return list(self.sched.running) + list(self.sched.waiting)

    # -- steps -----------------------------------------------------------
    def kick(self) -> None:
        if self.busy or not self.alive or not self.sched.has_work():
            return
        out = self.sched.schedule()
        if not out:
            return  # the head waits for blocks; a release kicks again
        prefill = decode = pairs = context = 0
        for e in out.entries:
            start = e.seq.num_computed_tokens
            if start >= e.seq.num_prompt_tokens:
                decode += 1
                context += start + 1
            else:
                prefill += e.num_new_tokens
                pairs += attention_pairs(start, e.num_new_tokens)
        dur = self.profile.step_s(prefill, decode, pairs, context)
        self.busy = True
        self._account(prefill, decode, dur)
        self.hooks.step_started(self, out, dur)
        self.clock.after(dur, self._done, out, self._generation)

    def _account(self, prefill: int, decode: int, dur: float) -> None:
        u = self.usage
        u.busy_s += dur
        u.steps += 1
        if prefill:
            u.prefill_tokens += prefill
            u.prefill_s += dur
        if decode and not prefill:
            u.decode_steps += 1
            u.decode_s += dur
        u.decode_tokens += decode

    def _done(self, out: SchedulerOutput, generation: int) -> None:
        if generation != self._generation:
            return  # the worker died meanwhile
        self.busy = False
        for e in out.entries:
            seq = e.seq
            if seq.status is SequenceStatus.FINISHED:
                continue  # released while its step ran
            seq.num_computed_tokens += e.num_new_tokens
            self._register(seq)
            if e.sample:
                seq.output_token_ids.append(0)
                last = len(seq.output_token_ids) >= seq.params.max_tokens
                if last:
                    self.sched.finish(seq, "length", free_blocks=self.view.role is not Role.PREFILL)
                self.hooks.token(self, seq, last)
        self.refresh()
        self.kick()

    def _register(self, seq: Sequence) -> None:
        """engine.LLMEngine._register_full_blocks: full blocks become findable by hash."""
        full = seq.num_computed_tokens // self.block_size
        if full > seq.num_registered_blocks:
            hashes = seq.hashes_up_to(full, self.block_size)
            for j in range(seq.num_registered_blocks, min(full, len(seq.block_table))):
                self.pool.cache_block(seq.block_table[j], hashes[j])
            seq.num_registered_blocks = full

    def refresh(self) -> None:
        """Accounts this worker's KV use; its load and prefix-cache events reach the routers now
        (``heartbeat_s`` 0: exact views) or at its next heartbeat (they lag as live views do)."""
        u, now = self.usage, self.clock.now
        used = (self.pool.num_blocks - self.pool.num_free) / self.pool.num_blocks
        u.kv_block_s += self._kv_used * (now - u.last_t) if u.last_t else 0.0
        u.last_t, self._kv_used = now, used
        u.kv_max = max(u.kv_max, used)
        if self.heartbeat_s <= 0:
            self.publish()
        elif not self._beat_due:  # one heartbeat event while something changed, none while idle
            self._beat_due = True
            k = -(-(now - self.phase_s) // self.heartbeat_s)  # the next tick at phase + k * interval
            self.clock.at(max(now, self.phase_s + k * self.heartbeat_s), self._beat)

    def _beat(self) -> None:
        self._beat_due = False
        if self.alive:
            self.publish()

    def publish(self) -> None:
        """What a heartbeat carries: the worker's load into its view, its prefix-cache events to the index."""
        v, s, u = self.view, self.sched, self.usage
        v.running, v.waiting, v.free_blocks = len(s.running), len(s.waiting), self.pool.num_free
        self.reported_queued = sum(max(0, q.num_prompt_tokens - q.num_computed_tokens)
                                   for q in (*s.waiting, *s.running))
        self.beats += 1  # the routers' changes since the last heartbeat are in this one
        self.show_pending(0)
        v.prefill_tokens_per_s = u.prefill_tokens / u.prefill_s if u.prefill_s else 0.0
        v.decode_step_s = u.decode_s / u.decode_steps if u.decode_steps else 0.0
        ev = self.pool.drain_events()
        if ev.stored or ev.removed:
            self.hooks.kv_events(self, ev.stored, ev.removed)

    def show_pending(self, since: int) -> None:
        """The placing router's change to this worker's queue since its last heartbeat (prompts sent
        less those prefilled): with lagging views, the queue it sees is the heartbeat's plus that."""
        lagging = self.heartbeat_s > 0
        self.view.queued_prefill_tokens = max(0, self.reported_queued + since) if lagging else self.reported_queued

    _kv_used = 0.0
    reported_queued = 0
    """Prompt tokens queued here, as its last heartbeat said."""
    beats = 0
    """Heartbeats sent so far."""
    heartbeat_s = 0.0
    """Interval of this worker's heartbeats to the routers (0: the routers see it exactly, at once)."""
    phase_s = 0.0
    """When in the interval its heartbeats fall."""
    _beat_due = False
