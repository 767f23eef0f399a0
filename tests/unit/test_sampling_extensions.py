"""The sampling extensions vLLM's clients send (repetition, presence and
frequency penalties, min_p, min_tokens), each checked against the engine's
output: greedy decoding with transformers' own logits processors (repetition
penalty, min_new_tokens) or with OpenAI's formula applied by hand to the
model's logits (presence and frequency), min_p on the sampler's draws, and a
request resumed after a failure continuing exactly where it stopped."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.sampler import Sampler, SampleRequest
from kvrelay.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 3, 42, 17, 8, 200, 17, 61, 5, 5, 130]


def hf_greedy(path, prompt: list[int], n: int, **kw) -> list[int]:
    """transformers' greedy generate on the same checkpoint (its processors, not ours)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_matches_transformers(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    eng = make_engine(path)
    eos = sorted(eng.eos_token_ids)
    plain, = eng.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))
    for penalty in (1.3, 0.8):
        ours, = eng.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=penalty))
        ref = hf_greedy(path, PROMPT, 24, repetition_penalty=penalty, eos_token_id=eos, min_new_tokens=24)
        assert ours.token_ids == ref, penalty
    assert ours.token_ids != plain.token_ids  # the penalty changed the greedy path


def test_min_tokens_holds_back_eos_and_stop_ids_as_transformers_does(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    eng = make_engine(path)
    plain, = eng.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    stop = plain.token_ids[2]  # greedy meets it at the third token at the latest
    stopped, = eng.generate([PROMPT], SamplingParams(max_tokens=12, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 3
    held, = eng.generate([PROMPT], SamplingParams(max_tokens=12, stop_token_ids=[stop], min_tokens=8))
    assert len(held.token_ids) >= 8 and stop not in held.token_ids[:7]
    ref = hf_greedy(path, PROMPT, 12, min_new_tokens=8, eos_token_id=sorted(eng.eos_token_ids | {stop}))
    assert held.token_ids == ref[:len(held.token_ids)]
    assert held.finish_reason == ("stop" if held.token_ids[-1] == stop else "length")


def _openai_penalized_greedy(eng, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """OpenAI's formula by hand on the model's own last-position logits, one token at a time."""
    out: list[int] = []
    for _ in range(n):
        logits = eng.prompt_logits(prompt + out)[0][-1].clone()
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        out.append(int(logits.argmax()))
    return out


def test_presence_and_frequency_penalties_follow_openais_formula(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"])
    plain, = eng.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))
    for presence, frequency in ((1.5, 0.0), (0.0, 0.7), (0.4, 0.4), (-1.0, 0.0)):
        ours, = eng.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=presence,
                                                     frequency_penalty=frequency))
        assert ours.token_ids == _openai_penalized_greedy(eng, PROMPT, 16, presence, frequency), (presence, frequency)
    strong, = eng.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=2.0))
    assert len(set(strong.token_ids)) > len(set(plain.token_ids))  # fewer repeats


@pytest.mark.parametrize("case", ["penalties", "seed", "min_tokens"])
def test_a_resumed_request_continues_exactly(tiny_checkpoints, make_engine, case):
    """After a failure the router resends prompt + what the client got, saying how much of it was
    output (prior_output_tokens): penalties, min_tokens and a seed's token index count it, so the
    continuation is what one uninterrupted run would have produced, and without it is not."""
    eng = make_engine(tiny_checkpoints["llama"])
    plain, = eng.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    stop = plain.token_ids[5]  # greedy's sixth token (it loops before: the penalties matter)
    assert stop not in plain.token_ids[:5]
    kw = {"penalties": dict(frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True),
          "seed": dict(temperature=0.9, seed=11, ignore_eos=True),
          "min_tokens": dict(stop_token_ids=[stop], min_tokens=5, ignore_eos=True)}[case]
    whole, = eng.generate([PROMPT], SamplingParams(max_tokens=12, **kw))
    got = whole.token_ids[:3]
    rest, = eng.generate([PROMPT + got], SamplingParams(max_tokens=12 - 3, prior_output_tokens=3, **kw))
    assert got + rest.token_ids == whole.token_ids
    fresh, = eng.generate([PROMPT + got], SamplingParams(max_tokens=12 - 3, **kw))
    assert fresh.token_ids != rest.token_ids


def test_min_p_never_draws_below_its_floor():
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.05, 0.03]])
    logits = probs.log()
    s = Sampler()
    p = SamplingParams(temperature=1.0, min_p=0.2)  # floor 0.1: tokens 3 and 4 are out
    drawn = {s(logits, [SampleRequest(p, seed, 0)])[0][0] for seed in range(300)}
    assert drawn == {0, 1, 2}
    p = SamplingParams(temperature=1.0)
    assert {s(logits, [SampleRequest(p, seed, 0)])[0][0] for seed in range(300)} == {0, 1, 2, 3, 4}


def test_penalties_leave_the_reported_logprobs_raw():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    p = SamplingParams(repetition_penalty=2.0, logprobs=True)
    toks, lps, _ = Sampler()(logits, [SampleRequest(p, 0, 0, prompt=[1, 3])])
    assert toks == [2]  # 5 / 2 < 4
    assert lps[0] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


@pytest.mark.parametrize("field, value, words", [
    ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 2]"),
    ("repetition_penalty", 2.5, "repetition_penalty must be in (0, 2]"),
    ("presence_penalty", -2.1, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be in [-2, 2]"),
    ("min_p", 1.01, "min_p must be in [0, 1]"),
    ("min_tokens", -1, "min_tokens must be an integer"),
    ("min_tokens", True, "min_tokens must be an integer"),
])
def test_out_of_range_values_are_refused_by_name(field, value, words):
    with pytest.raises(InvalidRequestError, match=words.replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(**{field: value})
