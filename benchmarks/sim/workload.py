"""The simulator's requests: a trace's arrivals and lengths (scaled as
``bench replay`` scales them) with the block-hash chains of the prompts
``bench replay`` would send: Mooncake ``hash_ids`` name shared 512-token
blocks (scaled), so requests sharing ids share those blocks' hashes; every
other prompt is unique."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.benchmarks.sim.worker import HASH_MASK, HashChain
from kvrelay.benchmarks.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, scale_lengths


@dataclass(slots=True)
class SimArrival:
    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    hash_ids: list[int]
    trace_block: int
    """Tokens per trace block after scaling (Mooncake)."""

    def chain(self, block_size: int) -> HashChain:
        """The prompt's chained block hashes (full blocks only)."""
        hashes: list[int] = []
        prev, tb = 0, self.trace_block
        for j in range(self.prompt_tokens // block_size):
            start, end = j * block_size, (j + 1) * block_size - 1
            k0, k1 = start // tb, end // tb
            key: tuple[int, ...]
            if k1 < len(self.hash_ids):
                key = (prev, self.hash_ids[k0], self.hash_ids[k1], start - k0 * tb)
            else:
                key = (prev, -1 - self.index, j)  # unique to this prompt
            prev = hash(key) & HASH_MASK
            hashes.append(prev)
        return HashChain(self.index, hashes)


def arrivals(reqs: list[TraceRequest], scale: float = 1.0, out_scale: float | None = None,
             speedup: float = 1.0, repeat: int = 1) -> list[SimArrival]:
    """The trace's requests (``repeat`` times, each copy after the previous
    one's last arrival), arrivals divided by ``speedup``."""
    tb = max(1, round(MOONCAKE_BLOCK_TOKENS * scale))
    lengths = scale_lengths(reqs, scale, out_scale)
    span = (reqs[-1].arrival_s if reqs else 0.0) + (reqs[-1].arrival_s / max(1, len(reqs) - 1) if reqs else 0.0)
    out: list[SimArrival] = []
    for copy in range(repeat):
        for r, (n_in, n_out) in zip(reqs, lengths):
            ids = [h + copy * (1 << 40) for h in r.hash_ids]  # copies do not share blocks
            out.append(SimArrival(len(out), (copy * span + r.arrival_s) / speedup, n_in, n_out, ids, tb))
    return out
