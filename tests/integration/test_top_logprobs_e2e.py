"""top_logprobs through the router on a disaggregated cluster: the decode
worker streams every token's alternatives but the first, which the router
takes from the prefill worker's answer."""

from __future__ import annotations

import grpc
import pytest

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.router.frontends.logprobs import openai_logprobs
from kvrelay.v1 import inference_pb2 as ipb

pytestmark = pytest.mark.model


def test_top_logprobs_match_the_engine_including_the_first_token(shared_stub, reference_engine):
    text = "Name three primary colours."
    req = ipb.GenerateRequest(messages=ipb.ChatMessages(messages=[ipb.ChatMessage(role="user", content=text)]),
                              max_tokens=8, sampling=ipb.SamplingParams(logprobs=True, top_logprobs=5))
    msgs = list(shared_stub.Generate(req, timeout=120))
    assert not msgs[-1].finish.placement.colocated
    ids = [t for m in msgs for t in m.token_ids]
    lps = [lp for m in msgs for lp in m.logprobs]
    tops = [t for m in msgs for t in m.top_logprobs]
    assert all(len(m.top_logprobs) == len(m.token_ids) for m in msgs)
    prompt = reference_engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    ref = reference_engine.generate([prompt], SamplingParams(max_tokens=8, logprobs=True, top_logprobs=5))[0]
    assert ids == ref.token_ids
    for got, want, lp in zip(tops, ref.top_logprobs, lps):
        assert list(got.token_ids) == want.token_ids
        assert list(got.logprobs) == pytest.approx(want.logprobs, abs=1e-3)
        assert got.logprobs[0] == pytest.approx(lp, abs=1e-6)
    out = openai_logprobs(reference_engine.tokenizer, True, ids, lps, tops)
    assert len(out["content"]) == len(ids) and all(len(c["top_logprobs"]) == 5 for c in out["content"])


def test_top_logprobs_out_of_bounds_is_invalid_argument(shared_stub):
    req = ipb.GenerateRequest(prompt="hi", max_tokens=2, sampling=ipb.SamplingParams(logprobs=True, top_logprobs=25))
    with pytest.raises(grpc.RpcError) as err:
        list(shared_stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_logprobs must be in [0, 20], got 25" in err.value.details()
