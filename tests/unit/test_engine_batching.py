"""Continuous batching: a sequence's greedy output does not depend on what
it is batched with, nor on being preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.sampling_params import SamplingParams

LENGTHS = [5, 17, 33, 64, 90, 120, 9, 48]


def prompts(n_vocab: int = 256, seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n_vocab, (n,), generator=g).tolist() for n in LENGTHS]


def run_alone(eng, ps, params):
    return [eng.generate([p], params)[0].token_ids for p in ps]


def test_batch_and_preemption_invariance_tiny(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ps = prompts()
    alone = run_alone(make_engine(path, prefix_caching=False), ps, params)
    batched = make_engine(path, prefix_caching=False).generate(ps, params)
    assert [o.token_ids for o in batched] == alone
    # 8 sequences need up to 11 blocks each; 40 blocks force preemption.
    tight = make_engine(path, num_blocks=40, max_batched=64)
    out = tight.generate(ps, params)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in out] == alone


@pytest.mark.model
@pytest.mark.slow  # ~60 s; CI runs the same invariance on the tiny model (above)
def test_batch_and_preemption_invariance_smollm(smollm_path, make_engine):
    eng = make_engine(smollm_path, num_blocks=512)
    texts = ["What is the capital of France?", "Name a colour.", "Count from one to five.",
             "Describe a cat in one sentence.", "What is 12 times 12?", "Say hello in French.",
             "Give me a word that rhymes with moon.", "What is the largest planet?"]
    ps = [eng.tokenizer.encode_chat([{"role": "user", "content": t * (1 + i % 3)}]) for i, t in enumerate(texts)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = run_alone(eng, ps, params)
    assert [o.token_ids for o in eng.generate(ps, params)] == alone
    tight = make_engine(smollm_path, num_blocks=24, max_batched=512)
    out = tight.generate(ps, params)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in out] == alone


def test_seeded_sampling_is_reproducible_across_batching(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    ps = prompts(seed=3)[:4]
    params = [SamplingParams(max_tokens=20, temperature=1.5, top_p=0.95, top_k=50, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    eng = make_engine(path)
    alone = [eng.generate([p], sp)[0].token_ids for p, sp in zip(ps, params)]
    assert [o.token_ids for o in eng.generate(ps, params)] == alone
    other_seed = eng.generate([ps[0]], SamplingParams(max_tokens=20, temperature=1.5, seed=999, ignore_eos=True))
    assert other_seed[0].token_ids != alone[0]


def test_abort_frees_blocks_and_others_continue(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"])
    ps = prompts()[:3]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = eng.generate([ps[1]], params)[0].token_ids
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    for _ in range(5):
        eng.step()
    assert eng.abort_request("r0") and eng.abort_request("r2")
    assert not eng.abort_request("r0")
    got = []
    while eng.has_unfinished():
        for out in eng.step():
            got += out.new_token_ids
    assert got[-25:] == expected[-25:]


def test_waiting_interactive_requests_are_admitted_before_batch_ones(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"], max_seqs=1)  # one at a time: the finishing order shows it
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    p = prompts()[0]
    eng.add_request("batch0", p, params, priority=1)
    eng.step()  # batch0 runs now; an interactive request does not preempt it
    for name, priority in [("batch1", 1), ("batch2", 1), ("interactive", 0), ("batch3", 1)]:
        eng.add_request(name, p, params, priority=priority)
    finished = []
    while eng.has_unfinished():
        finished += [out.request_id for out in eng.step() if out.finished]
    assert finished == ["batch0", "interactive", "batch1", "batch2", "batch3"]
