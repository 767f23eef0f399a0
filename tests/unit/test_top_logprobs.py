"""top_logprobs: validation, the sampler's and the engine's top-k, the wire
form, and the OpenAI shapes of router/frontends/logprobs.py with real tokenizers."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.sampler import Sampler, SampleRequest, TopLogprobs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.router.frontends.logprobs import openai_logprobs
from kvrelay.runtime.convert import output_to_proto, sampling_params
from kvrelay.v1 import inference_pb2 as ipb

TEXT = "Zürich 東京 🙂"


def test_top_logprobs_bounds_and_needs_logprobs():
    for k in (0, 1, 20):
        assert SamplingParams(logprobs=True, top_logprobs=k).top_logprobs == k
    with pytest.raises(InvalidRequestError, match=r"top_logprobs must be in \[0, 20\], got 25"):
        SamplingParams(logprobs=True, top_logprobs=25)
    for bad in (-1, True, 2.0):
        with pytest.raises(InvalidRequestError, match=r"top_logprobs must be in \[0, 20\]"):
            SamplingParams(logprobs=True, top_logprobs=bad)
    with pytest.raises(InvalidRequestError, match="top_logprobs needs logprobs"):
        SamplingParams(top_logprobs=3)
    # the proto's field reaches the engine's parameters (and their checks)
    sp = ipb.SamplingParams(logprobs=True, top_logprobs=4)
    assert sampling_params(sp, 8, [], [], False).top_logprobs == 4
    with pytest.raises(InvalidRequestError, match="got 21"):
        sampling_params(ipb.SamplingParams(logprobs=True, top_logprobs=21), 8, [], [], False)


def _check_tops(top: TopLogprobs, k: int, sampled: int | None, sampled_lp: float) -> None:
    assert len(top.token_ids) == len(top.logprobs) == k
    assert len(set(top.token_ids)) == k
    assert all(lp <= 0.0 for lp in top.logprobs)
    assert top.logprobs == sorted(top.logprobs, reverse=True)
    if sampled is not None:  # greedy: the sampled token is the most likely one
        assert top.logprobs[0] == pytest.approx(sampled_lp, abs=1e-6)
    if sampled in top.token_ids:  # one distribution for both
        assert top.logprobs[top.token_ids.index(sampled)] == pytest.approx(sampled_lp, abs=1e-6)


def test_sampler_top_logprobs_come_from_the_raw_distribution():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 300, generator=g) * 4
    rows = [SampleRequest(SamplingParams(logprobs=True, top_logprobs=5), 0, 0),
            SampleRequest(SamplingParams(logprobs=True), 0, 0),
            SampleRequest(SamplingParams(logprobs=True, top_logprobs=20, temperature=3.0, top_k=4), 9, 2)]
    toks, lps, tops = Sampler()(logits, rows)
    assert tops[1] is None
    _check_tops(tops[0], 5, toks[0], lps[0])
    _check_tops(tops[2], 20, None, lps[2])
    ref = torch.log_softmax(logits, dim=-1)
    assert tops[2].token_ids == ref[2].topk(20).indices.tolist()  # before temperature and top_k
    assert tops[2].logprobs == pytest.approx(ref[2].topk(20).values.tolist(), abs=1e-6)
    assert toks[2] in tops[2].token_ids[:4]  # top_k=4 sampled among the 4 most likely
    _, _, none = Sampler()(logits, [SampleRequest(SamplingParams(logprobs=True), 0, 0)])
    assert none is None


def test_engine_streams_top_logprobs_per_token(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"])
    prompt = list(range(40, 60))
    greedy, sampled, plain = eng.generate(
        [prompt] * 3, [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=6),
                       SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3,
                                      temperature=1.0, seed=3),
                       SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)])
    assert len(greedy.top_logprobs) == len(greedy.logprobs) == len(greedy.token_ids) == 12
    for t, lp, top in zip(greedy.token_ids, greedy.logprobs, greedy.top_logprobs):
        _check_tops(top, 6, t, lp)
        assert top.token_ids[0] == t
    for _t, lp, top in zip(sampled.token_ids, sampled.logprobs, sampled.top_logprobs):
        _check_tops(top, 3, None, lp)
        assert lp <= top.logprobs[0] + 1e-6
    assert plain.top_logprobs == [] and len(plain.logprobs) == 12


def test_first_token_sampled_elsewhere_gets_an_empty_entry(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2)
    eng.reserve("r", list(range(30)), params)
    first = eng.commit_prefilled("r", 65, -0.5)
    assert first.new_top_logprobs == [TopLogprobs([], [])]
    msg = output_to_proto(first)
    assert list(msg.token_ids) == [65] and len(msg.top_logprobs) == 1 and not msg.top_logprobs[0].token_ids
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    msgs = [output_to_proto(o) for o in outs]
    assert all(len(m.top_logprobs) == len(m.token_ids) == 1 for m in msgs)
    assert all(len(m.top_logprobs[0].token_ids) == 2 for m in msgs)
    assert msgs[0].top_logprobs[0].token_ids[0] == msgs[0].token_ids[0]


def _tokens_of(tok: Tokenizer) -> list[int]:
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    return ids


def _check_openai_shapes(tok: Tokenizer) -> None:
    ids = _tokens_of(tok)
    lps = [-0.25 * (i + 1) for i in range(len(ids))]  # exact in float32, as on the wire
    special = tok.token_to_id("<|im_start|>")
    tops = [ipb.TopLogprobs(token_ids=[t, special], logprobs=[lp, float("-inf")]) for t, lp in zip(ids, lps)]
    chat = openai_logprobs(tok, True, ids, lps, tops)["content"]
    assert b"".join(bytes(c["bytes"]) for c in chat) == TEXT.encode()
    assert [c["token"] for c in chat] == [bytes(c["bytes"]).decode("utf-8", "replace") for c in chat]
    assert [c["logprob"] for c in chat] == pytest.approx(lps)
    assert any("\ufffd" in c["token"] for c in chat)  # a character split over tokens
    for c in chat:
        assert c["top_logprobs"][0] == {"token": c["token"], "logprob": c["logprob"], "bytes": c["bytes"]}
        assert c["top_logprobs"][1]["logprob"] == -9999.0  # JSON has no -inf
        assert c["top_logprobs"][1]["token"] == "<|im_start|>"
    comp = openai_logprobs(tok, False, ids, lps, tops)
    assert comp["tokens"] == [c["token"] for c in chat]
    assert comp["token_logprobs"] == pytest.approx(lps)
    assert [next(iter(d)) for d in comp["top_logprobs"]] == comp["tokens"]
    # a token starts at the first character it completes (or continues)
    raw = [bytes(c["bytes"]) for c in chat]
    assert comp["text_offset"] == [len(b"".join(raw[:i]).decode("utf-8", "ignore")) for i in range(len(raw))]
    assert openai_logprobs(tok, False, ids, lps, [], text_offset=7)["top_logprobs"] is None
    assert openai_logprobs(tok, False, ids, lps, [], text_offset=7)["text_offset"][0] == 7
    assert all(c["top_logprobs"] == [] for c in openai_logprobs(tok, True, ids, lps, [])["content"])
    assert openai_logprobs(tok, True, ids, [], []) is None


def test_openai_logprobs_tiny_byte_tokenizer(tiny_checkpoints):
    _check_openai_shapes(Tokenizer(tiny_checkpoints["llama"]))


@pytest.mark.model
def test_openai_logprobs_smollm_tokenizer(smollm_path):
    tok = Tokenizer(smollm_path)
    _check_openai_shapes(tok)
    # every token's bytes decode as the library decodes that token alone
    for i in range(0, tok.vocab_size, 7):
        assert tok.token_bytes(i).decode("utf-8", "replace") == tok.decode([i], skip_special_tokens=False)
    assert tok.token_bytes(tok.vocab_size + 5) == b""
