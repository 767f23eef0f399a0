"""The time-to-first-token model, written once: each term as an expression that
takes Python floats (one candidate: ``place.estimate``, the figure a placement
reports and a deadline is checked against) or numpy arrays (every candidate at
once: the ``cost_model`` policy's choice, router/placement/cost_model.py), with the
same arithmetic in the same order, so both give the same number. The terms are
those of router/placement/place.py's docstring."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from kvrelay.engine.blocks import blocks_for
from kvrelay.router.placement.views import ClusterView

DISAGG_OVERHEAD_S = 0.002
"""Extra RPCs of a disaggregated request (reservation, prefill call), measured
on loopback at ~1-3 ms; charged to every disaggregated candidate."""

N = TypeVar("N", float, np.ndarray)


def throughputs(view: ClusterView) -> np.ndarray:
    """Each row's prefill throughput (tokens/s): its measured one, else the view's default."""
    tps = view.table.cols.prefill_tokens_per_s
    return np.where(tps != 0, tps, view.default_prefill_tokens_per_s)


def _least(a: Any, b: Any) -> Any:
    """min over floats (one candidate: a builtin, ~20x cheaper than a numpy call), else elementwise."""
    return min(a, b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else np.minimum(a, b)


def _most(a: Any, b: Any) -> Any:
    """max over floats, else elementwise (no NaN reaches either: a down link is no candidate)."""
    return max(a, b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else np.maximum(a, b)


def prefill_s(queued: N, prompt: int, cached_blocks: N, block_size: int, tput: N) -> N:
    """queue(P) + compute(P): P's queued prompt tokens, then this prompt's uncached ones, at P's throughput."""
    return (queued + prompt - _least(cached_blocks * block_size, prompt - 1)) / tput


def admission_s(waiting: N, decode_step_s: N) -> N:
    """admission(D): the sequences waiting at D, one decode step each."""
    return waiting * decode_step_s


def colocated_s(own_s: N, running: N, queued: N, tput: N, admission: N) -> N:
    """Colocated at D: its own compute, the stall it imposes on D's ``running`` sequences
    (0 for no interference), D's queued prompt tokens, admission."""
    return own_s + own_s * running + queued / tput + admission


def exposed_s(prompt: int, d_cached: N, view: ClusterView, gbps: N, rtt_ms: N, compute_s: N) -> N:
    """The KV transfer's exposed part plus the link's RTT: the blocks D does not hold over the
    link, less what layer-wise streaming overlaps with P's compute."""
    blocks = _most(0, blocks_for(prompt, view.block_size) - d_cached)
    transfer = blocks * view.kv_block_bytes * 8 / (gbps * 1e9)
    return _most(transfer / view.num_layers, transfer - compute_s) + rtt_ms / 1e3


def disaggregated_s(prefill_and_exposed: N, admission: N) -> N:
    """Disaggregated: queue(P) + compute(P) + exposed transfer, then admission at D and the extra RPCs."""
    return prefill_and_exposed + admission + DISAGG_OVERHEAD_S
