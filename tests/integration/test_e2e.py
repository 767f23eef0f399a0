"""End to end on real processes: router, prefill worker and decode worker on
loopback, KV over the TCP transport, the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.v1 import inference_pb2 as ipb
from tests.integration.helpers import (
    PROMPTS,
    chat_request,
    collect,
    reference,
    wait_until,
    warm_references,
    worker_stats,
)

pytestmark = pytest.mark.model

def test_greedy_outputs_match_engine_and_decode_never_prefills(shared_cluster, shared_stub, reference_engine):
    warm_references(reference_engine, PROMPTS)
    before = worker_stats(shared_cluster, "local/decode/0")
    for text in PROMPTS:
        tokens, msgs = collect(shared_stub, chat_request(text))
        assert tokens == reference(reference_engine, text), text
        fin = msgs[-1].finish
        assert fin.reason in (ipb.FINISH_REASON_STOP, ipb.FINISH_REASON_LENGTH)
        assert fin.usage.completion_tokens == len(tokens)
        assert not fin.placement.colocated and fin.placement.kv_bytes > 0
        assert fin.placement.prefill_worker == "local/prefill/0"
    after = worker_stats(shared_cluster, "local/decode/0")
    assert after.prefill_tokens_total == before.prefill_tokens_total  # the prompt was never recomputed
    assert after.kv_bytes_received > before.kv_bytes_received
    assert worker_stats(shared_cluster, "local/prefill/0").prefill_tokens_total > 0
    text = "".join(m.text for m in collect(shared_stub, chat_request(PROMPTS[0]))[1])
    assert "Paris" in text


def test_penalties_and_min_tokens_cross_the_cluster_as_the_engine_runs_them(shared_cluster, shared_stub,
                                                                            reference_engine):
    """vLLM's sampling extensions reach both workers: the prefill worker samples the first token
    with them, the decode worker the rest, and the answer is the engine's own with the same
    parameters (values exact in float32, as they cross the wire)."""
    sampling = ipb.SamplingParams(repetition_penalty=1.25, presence_penalty=0.75, frequency_penalty=0.5,
                                  min_tokens=12)
    params = SamplingParams(max_tokens=16, repetition_penalty=1.25, presence_penalty=0.75, frequency_penalty=0.5,
                            min_tokens=12)
    changed = False
    for text in PROMPTS[:2]:
        ids = reference_engine.tokenizer.encode_chat([{"role": "user", "content": text}])
        want = reference_engine.generate([ids], params)[0].token_ids
        tokens, msgs = collect(shared_stub, chat_request(text, max_tokens=16, sampling=sampling))
        assert tokens == want, text
        assert len(tokens) >= 12 and not msgs[-1].finish.placement.colocated
        changed |= tokens != reference(reference_engine, text, 16)
    assert changed  # the penalties changed what greedy decoding says


def test_32_concurrent_streams(shared_cluster, shared_stub, reference_engine):
    warm_references(reference_engine, PROMPTS, 16)
    expected = {t: reference(reference_engine, t, 16) for t in PROMPTS}
    results: dict[int, list[int]] = {}
    errors: list[Exception] = []

    def run(i: int) -> None:
        try:
            results[i] = collect(shared_stub, chat_request(PROMPTS[i % 8], max_tokens=16), timeout=300)[0]
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(320)
    assert not errors
    assert len(results) == 32
    for i, tokens in results.items():
        assert tokens == expected[PROMPTS[i % 8]]


def test_first_token_arrives_before_the_last_is_generated(shared_stub):
    req = chat_request("Tell me a long story about a lighthouse keeper.", max_tokens=48, ignore_eos=True)
    start = time.perf_counter()
    arrivals = []
    for msg in shared_stub.Generate(req, timeout=120):
        if msg.token_ids:
            arrivals.append(time.perf_counter())
    assert len(arrivals) == 48
    # Streamed, not buffered: most of the request's time passes between the
    # first token's arrival and the last one's (buffering would make it ~0).
    assert (arrivals[-1] - arrivals[0]) > 0.3 * (arrivals[-1] - start)


def _code(shared_stub, req) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        list(shared_stub.Generate(req, timeout=60))
    return err.value.code(), err.value.details()


def test_bad_inputs_get_clear_statuses_and_service_survives(shared_cluster, shared_stub, reference_engine):
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (ipb.GenerateRequest(prompt=""), INVALID, "prompt is empty"),
        (ipb.GenerateRequest(), INVALID, "no input"),
        (ipb.GenerateRequest(prompt="word " * 9000), INVALID, "context window"),
        (ipb.GenerateRequest(prompt="hi", max_tokens=-3), INVALID, "max_tokens"),
        (ipb.GenerateRequest(prompt="hi", max_tokens=10**9), INVALID, "exceeds the context window"),
        (ipb.GenerateRequest(prompt="hi", sampling=ipb.SamplingParams(temperature=-1)), INVALID, "temperature"),
        (ipb.GenerateRequest(prompt="hi", sampling=ipb.SamplingParams(top_p=1.5)), INVALID, "top_p"),
        (ipb.GenerateRequest(prompt="hi", sampling=ipb.SamplingParams(top_p=-0.2)), INVALID, "top_p"),
        (ipb.GenerateRequest(prompt="hi", model="gpt-17"), grpc.StatusCode.NOT_FOUND, "unknown model"),
        (ipb.GenerateRequest(prompt="hi", stop=["x"] * 10_000), INVALID, "at most 16 stop strings"),
        (ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[1, 10**7])), INVALID, "token ids"),
        (ipb.GenerateRequest(prompt="hi", allowed_jurisdictions=["FR"]), grpc.StatusCode.FAILED_PRECONDITION,
         "jurisdictions"),
    ]
    for req, code, text in cases:
        got, details = _code(shared_stub, req)
        assert got == code and text in details, (req, got, details)
    # Invalid UTF-8 in a string field, sent as raw bytes.
    with shared_cluster.channel() as ch:
        raw = ch.unary_stream("/kvrelay.v1.Inference/Generate", request_serializer=lambda b: b,
                              response_deserializer=ipb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\x12\x03\xff\xfe\xfd", timeout=30))
        assert err.value.code() == INVALID and "UTF-8" in err.value.details()
    # Still serving.
    assert collect(shared_stub, chat_request(PROMPTS[0]))[0] == reference(reference_engine, PROMPTS[0])


def test_client_disconnect_frees_blocks(shared_cluster, shared_stub):
    req = chat_request("Count slowly from one to one hundred.", max_tokens=200, ignore_eos=True)
    call = shared_stub.Generate(req, timeout=120)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 3:
            break
    call.cancel()

    def all_free(wid):
        s = worker_stats(shared_cluster, wid)
        return s.free_blocks == s.total_blocks and s.running == 0 and s.reservations == 0

    assert wait_until(lambda: all_free("local/decode/0"), 10)
    assert wait_until(lambda: all_free("local/prefill/0"), 10)
    assert collect(shared_stub, chat_request("Say hi.", max_tokens=4))[0]


def test_list_models_and_health(shared_stub):
    models = shared_stub.ListModels(ipb.ListModelsRequest(), timeout=10).models
    assert models[0].name == "SmolLM2-135M-Instruct" and models[0].chat and models[0].context_window == 8192
    health = shared_stub.Health(ipb.HealthRequest(), timeout=10)
    assert health.serving and health.prefill_workers == 1 and health.decode_workers == 1
