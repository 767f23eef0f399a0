"""Block pool and chained hashing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.errors import OutOfBlocksError
from kvrelay.engine.hashing import hash_block, hash_blocks


def test_hash_chain_properties():
    toks = list(range(64))
    hs = hash_blocks(toks, 16)
    assert len(hs) == 4 and len(set(hs)) == 4
    assert hash_blocks(toks + [1, 2, 3], 16) == hs  # partial block ignored
    assert hash_blocks(toks, 16, parent=hs[1], start_block=2) == hs[2:]
    assert hs[1] == hash_block(hs[0], toks[16:32])
    # Same block content at another position hashes differently (chained).
    same = [5] * 32
    a, b = hash_blocks(same, 16)
    assert a != b


@given(st.lists(st.integers(0, 50_000), min_size=16, max_size=64), st.text(max_size=8), st.text(max_size=8))
def test_different_salts_never_collide(tokens, s1, s2):
    if s1 == s2:
        return
    assert not set(hash_blocks(tokens, 16, s1)) & set(hash_blocks(tokens, 16, s2))


def test_refcounts_free_queue_and_prefix_cache():
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert pool.num_free == 5
    hs = [101, 102, 103]
    for b, h in zip(a, hs):
        pool.cache_block(b, h)
    assert pool.match_prefix([101, 102, 999]) == a[:2]
    assert pool.ref_count(a[0]) == 2
    pool.free(a)
    assert pool.num_free == 6  # a[2] freed; a[0], a[1] still held by the match
    pool.free(a[:2])
    assert pool.num_free == 8
    # Still cached while free; the tail block is evicted first.
    assert pool.num_cached_prefix(hs) == 3
    pool.allocate(6)
    assert pool.num_cached_prefix(hs) == 2  # 5 never-used blocks, then a[2]
    ev = pool.drain_events()
    assert ev.stored == hs and ev.removed == [103]
    with pytest.raises(OutOfBlocksError, match="need 3 KV blocks, 2 free"):
        pool.allocate(3)
    assert pool.num_free == 2


def test_double_free_is_an_error():
    pool = BlockPool(2)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "match"]), st.integers(1, 4)), max_size=60))
def test_pool_never_loses_blocks(ops):
    pool = BlockPool(16)
    held: list[list[int]] = []
    next_hash = 0
    for op, n in ops:
        if op == "alloc" and n <= pool.num_free:
            blocks = pool.allocate(n)
            for b in blocks:
                next_hash += 1
                pool.cache_block(b, next_hash)
            held.append(blocks)
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)))
        elif op == "match":
            got = pool.match_prefix(list(range(n, n + 3)))
            if got:
                held.append(got)
        referenced = {b for blocks in held for b in blocks}
        assert pool.num_free == 16 - len(referenced)
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == 16
