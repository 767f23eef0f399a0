"""Block arithmetic shared by the engine, the transport, the router and the benchmarks."""

from __future__ import annotations


def ceil_div(n: int, d: int) -> int:
    """``ceil(n / d)`` for non-negative integers, without floating point."""
    return -(-n // d)


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks hold ``tokens`` tokens."""
    return ceil_div(tokens, block_size)
