"""``kvrelay profile``: times a real engine's steps over a grid of
(prompt tokens, decode batch, context) and fits a MeasuredProfile.

Every point is the median of ``repeats`` timed steps. Decode batches share
one prompt (the prefix cache computes it once), so a batch of 32 at 512
tokens of context costs one prefill, while every sequence still attends its
whole context. The fit minimises the relative error (rows weighted by
1 / time) with non-negative coefficients.
"""

from __future__ import annotations

import itertools
import os
import random
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from kvrelay.benchmarks.machine import machine
from kvrelay.benchmarks.sim.profile import MeasuredProfile, ModelSpec, attention_pairs
from kvrelay.engine.config import CacheConfig, DType, EngineConfig, SchedulerConfig
from kvrelay.engine.llm_engine import LLMEngine, StepUsage
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class ProfileGrid:
    """What ``kvrelay profile`` times."""

    prompts: tuple[int, ...] = (16, 64, 128, 256, 512, 1024)
    """Prompt lengths prefilled in one step."""
    chunks: tuple[tuple[int, int], ...] = ((512, 512), (1024, 256))
    """(context already computed, chunk): a later chunk of a long prompt."""
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (64, 512)
    """Decode batch x context grid."""
    mixed: tuple[tuple[int, int, int], ...] = ((8, 256, 128), (16, 128, 256))
    """(decode batch, context, prompt tokens) in one step."""
    repeats: int = 3

    def blocks(self, block_size: int = CacheConfig().block_size) -> int:
        """KV blocks that hold the grid's largest point at once (decode batches
        share their prompt's full blocks; each sequence holds its own tail), doubled."""
        def ceil(n: int) -> int:
            return -(-n // block_size)
        tail = ceil(block_size + 8)  # a sequence's partial block and up to 8 decoded tokens
        need = [ceil(n) for n in self.prompts] + [ceil(c + k) for c, k in self.chunks]
        need += [ctx // block_size + b * tail for b in self.batches for ctx in self.contexts]
        need += [ctx // block_size + b * tail + ceil(n) for b, ctx, n in self.mixed]
        return 2 * max(need, default=1) + 16


NEIGHBOUR_GRID = ProfileGrid(prompts=(256, 128), chunks=(), batches=(4,), contexts=(256,), mixed=())
"""What a neighbour engine runs (see ``_neighbour``): its KV pool is sized from this."""
READY_DEADLINE_S = 120.0
"""How long the profiler waits for a neighbour engine to load its model."""


@dataclass(slots=True)
class Point:
    prefill: int
    decode: int
    pairs: int
    """Attention pairs of the prompt chunks."""
    context: int
    """KV tokens the decoding sequences attend to."""
    seconds: float


class _Timer:
    """What each engine step computed (recorded when it is scheduled) and how long it took (the step hook)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[StepUsage] = []
        self.work: list[Point] = []
        engine.step_hook = self.steps.append
        schedule = engine.scheduler.schedule

        def recording() -> SchedulerOutput:
            out = schedule()
            if out:
                pts = Point(0, 0, 0, 0, 0.0)
                for e in out.entries:
                    start = e.seq.num_computed_tokens
                    if start >= e.seq.num_prompt_tokens:
                        pts.decode += 1
                        pts.context += start + 1
                    else:
                        pts.prefill += e.num_new_tokens
                        pts.pairs += attention_pairs(start, e.num_new_tokens)
                self.work.append(pts)
            return out
        engine.scheduler.schedule = recording  # type: ignore[method-assign]  # records each step's work

    def clear(self) -> None:
        self.steps.clear()
        self.work.clear()

    def points(self) -> list[Point]:
        return [Point(w.prefill, w.decode, w.pairs, w.context, s.ns / 1e9) for w, s in zip(self.work, self.steps)]


class Profiler:
    def __init__(self, model_path: str, dtype: str = "float32", threads: int | None = 1,
                 num_blocks: int = 1024) -> None:
        """``num_blocks``: the KV pool (``ProfileGrid.blocks``); the pool is zeroed
        at start, so a larger one than the grid needs only costs start-up time."""
        self.threads = threads
        self.engine = LLMEngine(EngineConfig(Path(model_path), cast(DType, dtype),  # a DType: EngineConfig checks
                                             cache=CacheConfig(num_blocks=num_blocks),
                                             scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64),
                                             num_threads=threads))
        self.timer = _Timer(self.engine)
        self._ids = itertools.count()
        self.vocab = self.engine.model_config.vocab_size

    def _prompt(self, n: int, seed: int) -> list[int]:
        """``n`` token ids; prompts of different (n, seed) share no block."""
        rng = random.Random(f"{n}-{seed}")
        return [rng.randrange(5, self.vocab - 5) for _ in range(n)]

    def _add(self, reqs: list[tuple[list[int], int]]) -> None:
        for prompt, max_tokens in reqs:
            rid = f"p{next(self._ids)}"
            self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def _run(self, reqs: list[tuple[list[int], int]], budget: int = 4096, prime: list[int] | None = None,
             later: tuple[int, list[tuple[list[int], int]]] | None = None) -> list[Point]:
        """Runs requests (prompt, max_tokens) to the end; every step's point.
        ``prime``: a prompt computed first, so the requests find it in the prefix
        cache; ``later``: (after how many steps, requests) added mid-run."""
        if prime is not None:
            self._run([(prime, 1)])
        self.engine.scheduler.cfg.max_num_batched_tokens = budget
        self._add(reqs)
        self.timer.clear()
        while self.engine.has_unfinished():
            if later is not None and len(self.timer.steps) == later[0]:
                self._add(later[1])
            self.engine.step()
        return self.timer.points()

    def _median(self, make, pick) -> list[Point]:
        """The median time of ``repeats`` runs of ``make()``, for the steps ``pick`` selects."""
        runs = [pick(self._run(*make(k))) for k in range(self.grid.repeats)]
        out = []
        for pts in zip(*runs):
            out.append(Point(pts[0].prefill, pts[0].decode, pts[0].pairs, pts[0].context,
                             statistics.median(p.seconds for p in pts)))
        return out

    def measure(self, grid: ProfileGrid) -> list[Point]:
        need, have = grid.blocks(self.engine.cfg.cache.block_size), self.engine.pool.num_blocks
        if need > have:  # a pool too small for a point would preempt and time the preemption
            raise ValueError(f"the profile grid needs {need} KV blocks, the engine has {have}")
        self.grid = grid
        self._run([(self._prompt(64, 1), 4)])  # warm-up
        pts: list[Point] = []
        for n in grid.prompts:
            pts += self._median(lambda k: ([(self._prompt(n, 100 + k), 1)],), lambda ps: ps[:1])  # noqa: B023 (called before the loop moves on)
        for ctx, chunk in grid.chunks:  # budget ctx: the second step is the chunk after ctx tokens
            pts += self._median(lambda k: ([(self._prompt(ctx + chunk, 200 + k), 1)], ctx), lambda ps: ps[1:2])  # noqa: B023 (called before the loop moves on)
        for b, ctx in itertools.product(grid.batches, grid.contexts):
            pts += self._median(lambda k: ([(self._prompt(ctx, 300 + k), 6)] * b, 4096, self._prompt(ctx, 300 + k)),  # noqa: B023 (called before the loop moves on)
                                lambda ps: [p for p in ps if p.prefill == 0][1:4])
        for b, ctx, n in grid.mixed:  # the prompt arrives once the batch decodes
            pts += self._median(lambda k: ([(self._prompt(ctx, 400 + k), 8)] * b, 4096, self._prompt(ctx, 400 + k),  # noqa: B023 (called before the loop moves on)
                                           (2, [(self._prompt(n, 500 + k), 1)])),  # noqa: B023 (called before the loop moves on)
                                lambda ps: [p for p in ps if p.prefill and p.decode][:1])
        return pts

    def profile(self, grid: ProfileGrid, name: str, sharing: int = 1) -> MeasuredProfile:
        """Measures and fits; with ``sharing`` > 1, while ``sharing - 1`` other
        engines (processes like it) run a mixed load beside it, as the other
        workers of a deployment on the same machine do."""
        neighbours = [subprocess.Popen([sys.executable, "-m", "kvrelay.benchmarks.sim.profiler",
                                        str(self.engine.cfg.model_path), self.engine.cfg.dtype, str(self.threads or 0)],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                      for _ in range(sharing - 1)]
        try:
            for n in neighbours:  # their models load first
                _await_ready(n, time.monotonic() + READY_DEADLINE_S)
            pts = self.measure(grid)
        finally:
            for n in neighbours:
                n.kill()
                n.wait(10)
        (c0, c_prefill, c_decode, c_attend, c_context), err = fit(pts)
        cfg = self.engine.model_config
        params = param_count(cfg)
        spec = ModelSpec(name, float(params), cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim,
                         cfg.max_position_embeddings)
        return MeasuredProfile(spec, self.engine.cfg.dtype, c0, c_prefill, c_decode, c_attend, c_context,
                               source=f"measured by kvrelay profile on {machine().get('cpu', 'this CPU')}, "
                                      f"{self.threads or os.cpu_count()} torch thread(s), {self.engine.cfg.dtype}, "
                                      f"{sharing} engine(s) on the machine",
                               machine=machine() | {"threads": self.threads, "sharing": sharing},
                               fit={"points": len(pts), "median_rel_error": err,
                                    "rows": [[p.prefill, p.decode, p.pairs, p.context, p.seconds] for p in pts]})


def param_count(cfg) -> int:
    """Parameters of a Llama-family model from its config (embeddings, layers, head)."""
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size + 2 * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + cfg.num_layers * layer + h + head


def fit(pts: list[Point]) -> tuple[list[float], float]:
    """Non-negative coefficients (c0, prefill, decode, attend, context)
    minimising the relative error; and the median relative error of the fit."""
    x = np.array([[1.0, p.prefill, p.decode, p.pairs, p.context] for p in pts])
    y = np.array([p.seconds for p in pts])
    w = 1.0 / y
    active = list(range(5))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = [0.0] * 5
    for i, c in zip(active, coef):
        full[i] = max(0.0, float(c))
    pred = x @ np.array(full)
    return full, float(np.median(np.abs(pred - y) / y))


def _await_ready(proc: subprocess.Popen, deadline: float) -> None:
    """Waits for a neighbour's ``ready`` line (its engine is loaded and about to run)."""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
        if readable:
            line = proc.stdout.readline()
            if line.strip() == b"ready":
                return
            if not line:  # end of file: it exited (any other line is a library's output: read on)
                raise RuntimeError(f"a neighbour engine exited before it was ready (exit code {proc.wait(10)})")
    raise RuntimeError(f"a neighbour engine was not ready within {READY_DEADLINE_S:.0f} s")


LOAD_DEADLINE_S = 1800.0
"""A neighbour engine stops by itself after this long (the profiler kills it sooner)."""


def _neighbour(model_path: str, dtype: str, threads: int) -> None:
    """A neighbour's load: prompts and decode batches, as a worker runs them, until killed (or the deadline)."""
    prof = Profiler(model_path, dtype, threads or None, NEIGHBOUR_GRID.blocks())
    print("ready", flush=True)
    end = time.monotonic() + LOAD_DEADLINE_S
    k = 0
    while time.monotonic() < end:
        k += 1
        prof._run([(prof._prompt(256, 900 + k), 16)] * 4 + [(prof._prompt(128, 950 + k), 1)])


if __name__ == "__main__":
    _neighbour(sys.argv[1], sys.argv[2], int(sys.argv[3]))
