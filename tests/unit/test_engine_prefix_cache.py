"""Prefix caching: shared prefixes reuse blocks and give identical output;
salts isolate tenants."""

from __future__ import annotations

import pytest

from kvrelay.engine.sampling_params import SamplingParams

SYSTEM = "You are a careful assistant for a research network. Answer briefly and precisely. " * 2


def chat(eng, question: str) -> list[int]:
    return eng.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prefix_reuses_blocks_with_identical_output(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    cold = make_engine(path, prefix_caching=False)
    eng = make_engine(path)
    a, b = chat(eng, "What is a router?"), chat(eng, "What is a switch?")
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    first = eng.generate([a], params)[0]
    assert first.num_cached_tokens == 0
    hits_before = eng.stats().prefix_hit_blocks
    second = eng.generate([b], params)[0]
    assert second.num_cached_tokens == (shared // 16) * 16 > 0
    assert eng.stats().prefix_hit_blocks - hits_before == shared // 16
    assert second.token_ids == cold.generate([b], params)[0].token_ids
    # Identical prompt: everything but the last token comes from the cache.
    third = eng.generate([a], params)[0]
    assert third.num_cached_tokens == ((len(a) - 1) // 16) * 16
    assert third.token_ids == first.token_ids


def test_different_salts_never_share_blocks(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"])
    ids = chat(eng, "Same prompt for two tenants")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for rid, salt in (("a", "tenant-a"), ("b", "tenant-b")):
        eng.add_request(rid, ids, params, salt=salt)
    cached = {}
    while eng.has_unfinished():
        for out in eng.step():
            cached[out.request_id] = out.num_cached_tokens
    assert cached == {"a": 0, "b": 0}
    eng.add_request("a2", ids, params, salt="tenant-a")
    while eng.has_unfinished():
        for out in eng.step():
            cached[out.request_id] = out.num_cached_tokens
    assert cached["a2"] > 0
