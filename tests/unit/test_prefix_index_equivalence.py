"""The bitmask prefix index answers exactly as the earlier set-based one
(kept as tests/unit/prefix_index_reference.py) under random stores,
removals, snapshots and workers leaving and coming back."""

from __future__ import annotations

import random

from kvrelay.router.placement.prefix_index import PrefixIndex
from tests.unit.prefix_index_reference import PrefixIndex as Reference


def test_leading_blocks_match_the_previous_index():
    rng = random.Random(5)
    chains = [[rng.getrandbits(64) for _ in range(40)] for _ in range(6)]
    new, old = PrefixIndex(), Reference()
    workers = [f"s/decode/{i}" for i in range(70)]
    checked = 0
    for step in range(3000):
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.05:
            new.remove_worker(w)
            old.remove_worker(w)
        else:
            chain = rng.choice(chains)
            stored = chain[:rng.randrange(0, 40)] + rng.sample(chain, 3)  # prefixes, and stray blocks
            removed = rng.sample(chain, rng.randrange(0, 4))
            snap = op > 0.97
            new.apply(w, stored, removed, snap)
            old.apply(w, stored, removed, snap)
        if step % 10 == 0:
            for chain in chains:
                q = chain[:rng.randrange(0, 41)]
                assert new.leading_blocks(q) == old.leading_blocks(q), step
                checked += bool(old.leading_blocks(q))
        assert new.blocks_of(w) == old.blocks_of(w)
    assert checked > 500


def test_hash_blocks_equals_the_chain_of_hash_block():
    from kvrelay.engine.hashing import hash_block, hash_blocks

    rng = random.Random(9)
    for _ in range(50):
        bs = rng.choice([1, 4, 16])
        toks = [rng.randrange(0, 1 << 17) for _ in range(rng.randrange(0, 300))]
        salt = rng.choice(["", "tenant-a", "é"])
        want, parent = [], None
        for i in range(len(toks) // bs):
            parent = hash_block(parent, toks[i * bs:(i + 1) * bs], salt)
            want.append(parent)
        assert hash_blocks(toks, bs, salt) == want
        k = rng.randrange(0, len(want) + 1)
        assert hash_blocks(toks, bs, salt, want[k - 1] if k else None, k) == want[k:]


def test_a_match_keeps_its_names_and_maps_to_view_rows_as_a_dict_would():
    """A PrefixMatch is read by bit position; it must name the workers the
    index had when it answered, even after a bit is freed and reused, and a
    view must read the same depths from it as from the equivalent dict."""
    from kvrelay.router.placement.views import ClusterView, WorkerView

    rng = random.Random(11)
    chain = [rng.getrandbits(64) for _ in range(30)]
    ix, ref = PrefixIndex(), Reference()
    names = [f"s/decode/{i}" for i in range(200)]
    for w in names:
        held = chain[:rng.randrange(1, 31)]
        ix.apply(w, held, [])
        ref.apply(w, held, [])
    before = ix.leading_blocks(chain)
    frozen = dict(before)
    assert len(frozen) == 200 and frozen == ref.leading_blocks(chain)
    ix.remove_worker(names[7])
    ix.apply("s/decode/new", chain, [])  # takes the freed bit
    assert dict(before) == frozen and "s/decode/new" not in before
    after = ix.leading_blocks(chain)
    assert after["s/decode/new"] == 30 and names[7] not in after
    assert after.get(names[3], 0) == frozen[names[3]]  # read by bit
    ix.apply("s/decode/late", chain, [])  # joins after the answer (a new bit at the end)
    assert after.get("s/decode/late", 0) == 0 and "s/decode/late" not in dict(after)
    rows = [WorkerView(w, "decode", "s") for w in rng.sample(names, 120) + ["s/decode/new", "elsewhere"]]
    table = ClusterView(rows, {"s": "CA"}).table
    for match in (before, after, ix.leading_blocks(chain[:5]), ix.leading_blocks([1, 2])):
        got = [match.get(w.worker_id, 0) for w in rows]  # by bit (before: by name, the index moved on)
        assert table.cached(match).tolist() == got
        assert table.cached(dict(match)).tolist() == got
