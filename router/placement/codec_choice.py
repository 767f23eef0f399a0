"""``links[].kv_codec: auto``: the codec of one request's KV over its link,
chosen when its placement is known. The least lossy of the deployment's
``kv.auto_codecs`` whose estimated exposed transfer (what layer-wise
streaming does not hide behind the prefill: router/placement/estimate.py's
``exposed_s`` term, without the RTT every codec pays) is within
:func:`tolerance_s` of the fastest's: lossless whenever the link keeps up
with the prefill, fewer bytes only where they buy a noticeable share of the
time to first token."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvrelay.runtime.topology import KVCodec

LOSSINESS = (KVCodec.NONE, KVCodec.INT8, KVCodec.FP8, KVCodec.INT4)
"""Least lossy first, by measured greedy agreement on SmolLM2 (100%, 85%, 44%, 15%: benchmarks/RESULTS.md)."""
TOLERANCE_S = 0.02
"""Exposed time a less lossy codec may always cost over the fastest choice and still be chosen..."""
TOLERANCE_SHARE = 0.05
"""... or this share of the prefill's time, when more: 5% of the time to first token is not worth answers."""


def tolerance_s(compute_s: float) -> float:
    """What a less lossy codec may cost over the fastest choice, for a prefill of ``compute_s``."""
    return max(TOLERANCE_S, TOLERANCE_SHARE * compute_s)


def exposed_transfer_s(kv_bytes: float, gbps: float, compute_s: float, num_layers: int) -> float:
    """The part of sending ``kv_bytes`` over ``gbps`` that a prefill of ``compute_s`` does not hide
    (at least one layer's share: the last layer leaves after the compute)."""
    transfer = kv_bytes * 8 / (gbps * 1e9)
    return max(transfer / max(1, num_layers), transfer - compute_s)


def choose_codec(candidates: Sequence[KVCodec], fraction: Callable[[KVCodec], float], kv_bytes: float,
                 gbps: float, compute_s: float, num_layers: int) -> KVCodec:
    """The least lossy of ``candidates`` within :func:`tolerance_s` of the least exposed transfer;
    ``fraction``: the bytes each codec sends per byte of KV (runtime/topology.py ``Topology.fraction``)."""
    cost = {c: exposed_transfer_s(kv_bytes * fraction(c), gbps, compute_s, num_layers) for c in candidates}
    best = min(cost.values()) + tolerance_s(compute_s)
    return next(c for c in LOSSINESS if c in cost and cost[c] <= best)
