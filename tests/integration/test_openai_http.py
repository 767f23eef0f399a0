"""The router's OpenAI-compatible HTTP API, driven by the official `openai`
Python client against a real local cluster (router, prefill and decode
worker processes), compared with the gRPC API on the same requests; bad
inputs get OpenAI-shaped errors with the right HTTP statuses, and the
service keeps serving. What is asserted is the API's shape, not what the
model says: the cluster serves the plumbing model (SmolLM2's tokens and
model id, about a twelfth of its cost per token)."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.launch import vllm_env
from kvrelay.router.core.auth import token_sha256
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import CLUSTER_YAML, running_cluster, tls_context, wait_until, workers

pytestmark = pytest.mark.model

TOKEN = "test-client-token"
OTHER = "other-tenant-token"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What does a network router do?"
RAW = "The three primary colours are"


@pytest.fixture(scope="module")
def http_cluster(plumbing_model):
    raw = copy.deepcopy(CLUSTER_YAML)
    raw["router"] |= {"http_port": 0, "admission": {"max_inflight_per_worker": 2, "admission_wait_s": 0.2,
                                                    "unavailable_wait_s": 0.5},
                      "liveness": {"heartbeat_interval_s": 0.25, "worker_timeout_s": 2.0}}  # the last test waits it
    raw["tenants"] = [{"name": "lab-a", "token_sha256": token_sha256(TOKEN)},
                      {"name": "lab-b", "token_sha256": token_sha256(OTHER)}]
    with running_cluster(raw, plumbing_model, reconcile=False) as lc:
        yield lc


@pytest.fixture(scope="module")
def http_stub(http_cluster):
    """The public gRPC API of this module's cluster (the tenant lab-a's token comes per call)."""
    with http_cluster.channel() as ch:
        yield igrpc.InferenceStub(ch)


@pytest.fixture(scope="module")
def client(http_cluster):
    return openai.OpenAI(base_url=f"https://{http_cluster.http_address}/v1", api_key=TOKEN, max_retries=0, timeout=120,
                         http_client=HTTP_CLIENT(verify=tls_context(http_cluster)))


@pytest.fixture(scope="module")
def tok(plumbing_model):
    return Tokenizer(plumbing_model)


HTTP_CLIENT = getattr(openai, "DefaultHttpx2Client", None) or openai.DefaultHttpxClient
"""The HTTP client class the installed openai package builds on (httpx2 from openai 3)."""
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def grpc_tokens(http_stub, req: ipb.GenerateRequest) -> tuple[list[int], str, ipb.Finish]:
    msgs = list(http_stub.Generate(req, timeout=120, metadata=AUTH))
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs[-1].finish


def test_chat_matches_grpc_and_usage_matches_the_tokenizer(client, http_stub, tok):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=24, temperature=0)
    ids, text, fin = grpc_tokens(http_stub, ipb.GenerateRequest(
        messages=ipb.ChatMessages(messages=[ipb.ChatMessage(role="user", content=QUESTION)]), max_tokens=24))
    assert resp.choices[0].message.content == text and text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == ("length" if len(ids) == 24 else "stop")
    assert resp.usage.prompt_tokens == len(tok.encode_chat([{"role": "user", "content": QUESTION}]))
    assert resp.usage.completion_tokens == len(ids) == fin.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.model == MODEL and resp.object == "chat.completion"
    # kvrelay's extension object: where it ran
    ext = resp.model_extra["kvrelay"]
    assert ext["placement"]["decode_worker"] == "local/decode/0"


def test_chat_stream_with_usage_equals_the_whole_answer(client, tok):
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": QUESTION}], max_completion_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].choices[0].finish_reason == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == len(tok.encode_chat([{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": QUESTION}]))
    # without include_usage no chunk carries usage
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in plain)


def test_completions_match_grpc_raw_prompt(client, http_stub, tok):
    resp = client.completions.create(model=MODEL, prompt=RAW, max_tokens=12, temperature=0)
    ids, text, _ = grpc_tokens(http_stub, ipb.GenerateRequest(prompt=RAW, raw_prompt=True, max_tokens=12))
    assert resp.choices[0].text == text and resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(tok.encode(RAW)) and resp.usage.completion_tokens == len(ids)
    streamed = list(client.completions.create(model=MODEL, prompt=RAW, max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    assert streamed[-1].usage.completion_tokens == len(ids)
    # token ids as the prompt, and stop strings
    by_ids = client.completions.create(model=MODEL, prompt=tok.encode(RAW), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == text
    first_word = text.split()[0]
    stopped = client.completions.create(model=MODEL, prompt=RAW, max_tokens=12, temperature=0, stop=[first_word])
    assert first_word not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=RAW, max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_models_and_health(client, http_cluster):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    with urllib.request.urlopen(f"https://{http_cluster.http_address}/health", timeout=10,
                               context=tls_context(http_cluster)) as r:
        body = json.load(r)
    assert r.status == 200 and body["serving"] and body["decode_workers"] == 1


def _post(http_cluster, path: str, body, token: str | None = TOKEN, raw: bytes | None = None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"https://{http_cluster.http_address}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60, context=tls_context(http_cluster)) as r:
            return r.status, json.load(r), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.load(e), e.headers


def test_bad_inputs_get_openai_errors_with_the_right_status(client, http_cluster):
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [  # the same mistakes as the gRPC API's test (test_e2e.py), and HTTP-only ones
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt is empty"),
        (chat, {"model": MODEL}, 400, "'messages'"),
        (chat, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "context window"),
        (chat, {"model": MODEL, "messages": msgs, "max_tokens": -3}, 400, "max_tokens"),
        (chat, {"model": MODEL, "messages": msgs, "max_tokens": 10**9}, 400, "exceeds the context window"),
        (chat, {"model": MODEL, "messages": msgs, "temperature": -1}, 400, "temperature"),
        (chat, {"model": MODEL, "messages": msgs, "top_p": 1.5}, 400, "top_p"),
        (chat, {"model": "gpt-17", "messages": msgs}, 404, "unknown model"),
        (chat, {"model": MODEL, "messages": msgs, "stop": ["x"] * 10_000}, 400, "at most 16 stop strings"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 10**7]}, 400, "token ids"),
        (chat, {"model": MODEL, "messages": msgs, "kvrelay": {"allowed_jurisdictions": ["FR"]}}, 400,
         "jurisdictions"),
        (chat, {"model": MODEL, "messages": msgs, "n": 2}, 400, "n must be 1"),
        (chat, {"model": MODEL, "messages": msgs, "temperature": "hot"}, 400, "'temperature' must be a number"),
        (chat, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "only text parts"),
        (chat, [1, 2], 400, "JSON object"),
    ]
    for path, body, status, text in cases:
        got, err, _ = _post(http_cluster, path, body)
        assert got == status and text in err["error"]["message"], (body, got, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}
    got, err, _ = _post(http_cluster, chat, None, raw=b"{not json")
    assert got == 400 and "not valid JSON" in err["error"]["message"]
    # credentials are required here: missing or wrong -> 401, through the openai client too
    for token in (None, "wrong-token"):
        got, err, _ = _post(http_cluster, chat, {"model": MODEL, "messages": msgs}, token=token)
        assert got == 401 and err["error"]["type"] == "authentication_error", err
    bad = openai.OpenAI(base_url=f"https://{http_cluster.http_address}/v1", api_key="wrong", max_retries=0,
                        http_client=HTTP_CLIENT(verify=tls_context(http_cluster)))
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-17", messages=msgs, max_tokens=2)
    assert nf.value.status_code == 404
    got, err, _ = _post(http_cluster, "/v1/nothing", {})
    assert got == 404
    # still serving
    assert client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3).usage.completion_tokens >= 1


def test_tenants_authenticate_on_grpc_and_see_only_their_own_jobs(http_cluster, http_stub):
    from kvrelay.v1 import jobs_pb2 as jpb
    from kvrelay.v1 import jobs_pb2_grpc as jgrpc

    with pytest.raises(grpc.RpcError) as err:
        list(http_stub.Generate(ipb.GenerateRequest(prompt="hi", max_tokens=2), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "tenants" in err.value.details()
    other = (("authorization", f"Bearer {OTHER}"),)
    with http_cluster.channel() as ch:
        jobs = jgrpc.JobsStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            jobs.SubmitJob(jpb.SubmitJobRequest(requests=[ipb.GenerateRequest(prompt="hi", max_tokens=2)]), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        job = jobs.SubmitJob(jpb.SubmitJobRequest(name="mine", requests=[
            ipb.GenerateRequest(prompt="hi", max_tokens=2), ipb.GenerateRequest(prompt="bye", max_tokens=2)]),
            timeout=30, metadata=AUTH)
        results = list(jobs.JobResults(jpb.JobResultsRequest(id=job.id, follow=True), timeout=120, metadata=AUTH))
        assert sorted(r.index for r in results) == [0, 1] and all(r.finish.usage.completion_tokens for r in results)
        assert [j.id for j in jobs.ListJobs(jpb.ListJobsRequest(), timeout=10, metadata=AUTH).jobs] == [job.id]
        # another tenant neither lists nor reads it: to lab-b it does not exist
        assert list(jobs.ListJobs(jpb.ListJobsRequest(), timeout=10, metadata=other).jobs) == []
        for call in (lambda: jobs.GetJob(jpb.GetJobRequest(id=job.id), timeout=10, metadata=other),
                     lambda: jobs.CancelJob(jpb.CancelJobRequest(id=job.id), timeout=10, metadata=other),
                     lambda: list(jobs.JobResults(jpb.JobResultsRequest(id=job.id), timeout=10, metadata=other))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


LONG = 600
"""Tokens of the two requests that fill the decode worker: ~5 s on one thread, far longer than
the refused request's admission wait (0.2 s)."""


def test_admission_refusal_is_429_with_retry_after(client, http_cluster):
    """max_inflight_per_worker is 2 here: a third request finds the only decode
    worker full and, after router.admission.admission_wait_s, is refused; the two
    it waited behind run on to their end."""
    def long_request():
        return client.completions.create(model=MODEL, prompt=RAW, max_tokens=LONG, temperature=0,
                                         extra_body={"kvrelay": {"ignore_eos": True}})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(long_request) for _ in range(2)]
        assert wait_until(lambda: workers(http_cluster)["local/decode/0"].inflight == 2, 60, 0.05)
        got, err, headers = _post(http_cluster, "/v1/completions", {"model": MODEL, "prompt": RAW, "max_tokens": 4})
        still_running = not any(f.done() for f in running)
        assert got == 429 and err["error"]["type"] == "rate_limit_error", err
        assert int(headers["Retry-After"]) >= 1
        assert all(f.result().usage.completion_tokens == LONG for f in running)
        assert still_running, "a long request ended before the third was refused: the refusal proves nothing"


def test_a_request_shaped_as_vllm_bench_serve_sends_it_is_served(http_cluster):
    """vLLM's own benchmark client (``vllm bench serve``, openai-completions backend)
    posts exactly these fields, ``repetition_penalty: 1.0`` among them, over HTTPS
    with a bearer token, and reads the last chunk of the stream for usage."""
    body = {"model": MODEL, "prompt": RAW, "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 5,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with HTTP_CLIENT(verify=tls_context(http_cluster), timeout=120) as http, \
            http.stream("POST", f"https://{http_cluster.http_address}/v1/completions", json=body,
                        headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["usage"]["completion_tokens"] == 5  # ignore_eos: the whole length
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"])


@pytest.mark.slow  # 19 s (vLLM's CLI starting); in CI: the request it sends, served (above)
def test_vllm_bench_serve_gets_every_request_served(http_cluster, plumbing_model, tmp_path):
    """vLLM's own benchmark client, installed by make test, against kvrelay's HTTPS API with a
    tenant's token: every request succeeds, each with the output length it asked for."""
    if vllm_env.installed_version() is None:
        pytest.skip("vllm is not installed (make test installs it: make vllm)")
    env = {**os.environ, "OPENAI_API_KEY": TOKEN, "SSL_CERT_FILE": str(http_cluster.ca_file),
           "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = ["bench", "serve", "--backend", "openai", "--base-url", f"https://{http_cluster.http_address}",
            "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(plumbing_model),
            "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "6",
            "--num-prompts", "6", "--max-concurrency", "2", "--ignore-eos", "--seed", "1",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    res = subprocess.run([sys.executable, "-m", "kvrelay.launch.vllm_env", "cli", *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result.get("failed", 0)) == (6, 0), res.stdout[-3000:]
    assert result["total_output_tokens"] == 6 * 6


def test_stop_token_ids_end_the_output_at_the_first_one_sampled(client, http_stub):
    ids, _, _ = grpc_tokens(http_stub, ipb.GenerateRequest(prompt=RAW, raw_prompt=True, max_tokens=8, ignore_eos=True))
    third = ids[2]  # greedy: the same tokens again over HTTP, so the output ends where this one first appears
    kw = {"model": MODEL, "prompt": RAW, "max_tokens": 8, "temperature": 0}
    stopped = client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [third]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == ids.index(third) + 1


def test_no_decode_worker_is_503_and_health_says_so(http_cluster):
    """Last in this module: the only decode worker is killed (the launcher does not replace it here)."""
    decode = next(c for c in http_cluster.children if c.name == "local/decode/0")
    decode.proc.send_signal(signal.SIGKILL)
    decode.proc.wait(10)
    # the router marks it dead after liveness.worker_timeout_s without a heartbeat (2 s here)
    assert wait_until(lambda: not getattr(workers(http_cluster).get("local/decode/0"), "healthy", False), 30, 0.1)
    got, err, _ = _post(http_cluster, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert got == 503 and err["error"]["type"] == "service_unavailable", err
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"https://{http_cluster.http_address}/health", timeout=10,
                               context=tls_context(http_cluster))
    assert e.value.code == 503
