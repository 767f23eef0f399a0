"""Sampler and incremental detokenizer."""

from __future__ import annotations

import torch

from kvrelay.engine.sampler import Sampler, SampleRequest
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import IncrementalDetokenizer, Tokenizer


def test_greedy_top_k_top_p():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9], [3.0, 0.0, 0.0, 0.0]])
    s = Sampler()
    toks, lps, _ = s(logits, [SampleRequest(SamplingParams(logprobs=True), 0, 0),
                              SampleRequest(SamplingParams(), 0, 0)])
    assert toks == [1, 0]
    assert abs(lps[0] - torch.log_softmax(logits[0], -1)[1].item()) < 1e-6
    # top_k=1 and a tiny top_p are greedy whatever the temperature and seed.
    for seed in range(20):
        for p in (SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=0.01)):
            assert s(logits[:1], [SampleRequest(p, seed, 3)])[0] == [1]
    # top_k=2 only ever picks the two best tokens.
    picks = {s(logits[:1], [SampleRequest(SamplingParams(temperature=10.0, top_k=2), seed, 0)])[0][0]
             for seed in range(200)}
    assert picks == {1, 3}


def test_seeded_sampling_depends_on_seed_and_index_only():
    logits = torch.randn(1, 1000)
    s = Sampler()
    p = SamplingParams(temperature=1.0)
    draw = lambda seed, idx: s(logits, [SampleRequest(p, seed, idx)])[0][0]  # noqa: E731
    assert draw(7, 3) == draw(7, 3)
    assert len({draw(7, i) for i in range(30)}) > 10
    assert len({draw(seed, 0) for seed in range(30)}) > 10


def test_incremental_detokenizer_and_stop_strings(tiny_checkpoints):
    tok = Tokenizer(tiny_checkpoints["llama"])
    text = "naïve café 東京 — done. STOP here"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], [])
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.take(final=False))
    pieces.append(d.take(final=True))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    d = IncrementalDetokenizer(tok, [], ["STOP", "done!"])
    streamed = ""
    for t in ids:
        d.add(t)
        streamed += d.take(final=False)
        if d.stopped:
            break
    streamed += d.take(final=True)
    assert d.stopped and streamed == "naïve café 東京 — done. "


def test_chat_template(tiny_checkpoints):
    tok = Tokenizer(tiny_checkpoints["llama"])
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.token_to_id("<|im_start|>")
