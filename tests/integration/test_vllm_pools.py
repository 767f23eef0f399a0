"""Pools that run vLLM (issue 34): a real cluster whose workers run vLLM's
engine (the CPU build `make test` installs), with kvrelay's connector
moving the KV over its sealed TCP transport.

One module-scoped cluster (vLLM engines take seconds to start) on the
plumbing model, two sites: toronto (CA-ON) has a vLLM prefill pool (whose
step budget is below the long prompt: chunked prefill) and two vLLM decode
workers; montreal (CA-QC) a builtin prefill pool beside a vLLM
decode pool, whose layouts differ. What is asserted is who computes what,
what moves, what is freed, where, and that the answer is vLLM's own: the
reference is vLLM alone (``vllm.LLM``, greedy) in a child process, on the
same prompt tokens."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.engine.tiny import write_tiny_checkpoint
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.runtime.engines import vllm_installed
from kvrelay.runtime.tracing import read_spans
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import (
    CLUSTER_YAML,
    chat_request,
    running_cluster,
    stream_killing_its_decode_worker,
    vllm_alone,
    wait_until,
    worker_stats,
    workers,
)

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make vllm)")]

VLLM_POOL = {"engine": "vllm", "vllm": {"max_model_len": 2048, "kv_cache_memory_gib": 0.125}}
TORONTO_P, MONTREAL_P = "toronto/prefill/0", "montreal/prefill/0"
TORONTO_D = ("toronto/decode/0", "toronto/decode/1")
MONTREAL_D = "montreal/decode/0"
TEXTS = ["Hello there, how are you?", "Tell me about Toronto and its winters. " * 12]
MAX_TOKENS = 12
LONG_TOKENS = 300
"""The stream a decode worker is killed in."""
CHUNK = 64
"""Toronto's prefill pool computes at most this many tokens a step: a longer prompt, in chunks."""

@pytest.fixture(scope="module")
def span_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-traces")


@pytest.fixture(scope="module")
def vllm_cluster(plumbing_model, span_dir):
    raw = copy.deepcopy(CLUSTER_YAML)
    raw["telemetry"] = {"traces": "file", "file": str(span_dir / "{process}.jsonl")}
    raw["router"]["placement"]["policy"] = "prefix_aware"
    raw["sites"] = [
        {"name": "toronto", "jurisdiction": "CA-ON",
         "prefill": {**VLLM_POOL, "vllm": {**VLLM_POOL["vllm"], "max_num_batched_tokens": CHUNK}},
         "decode": {**VLLM_POOL, "replicas": 2}},
        {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 1}, "decode": dict(VLLM_POOL)}]
    raw["links"] = [{"between": ["toronto", "montreal"], "rtt_ms": 5, "gbps": 10}]
    with running_cluster(raw, plumbing_model) as lc:
        assert wait_until(lambda: len(workers(lc)) == 5, 60)
        yield lc


def token_request(ids: list[int], max_tokens: int = MAX_TOKENS, **kw) -> ipb.GenerateRequest:
    return ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=max_tokens, ignore_eos=True, **kw)


def generate(lc, req: ipb.GenerateRequest) -> tuple[list[int], ipb.Finish]:
    with lc.channel() as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=120))
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish


def computed_prompt_tokens(lc) -> dict[str, int]:
    return {w: worker_stats(lc, w).prefill_tokens_total for w in workers(lc)}


@pytest.fixture(scope="module")
def references(plumbing_model):
    tok = Tokenizer(plumbing_model)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]
    return prompts, vllm_alone(plumbing_model, prompts + prompts[:1], [MAX_TOKENS] * len(prompts) + [LONG_TOKENS])


def test_disaggregated_answer_is_vllms_and_the_prompt_was_moved(vllm_cluster, references):
    prompts, expected = references
    ws = workers(vllm_cluster)
    p = ws[TORONTO_P].info
    assert all(ws[d].info.layout_hash == p.layout_hash for d in (*TORONTO_D, MONTREAL_D)) and p.block_size == 128
    assert ws[MONTREAL_P].info.layout_hash != p.layout_hash, "the builtin pool registers its own layout"
    # the long prompt fits no step of the prefill worker's: vLLM computes it in chunks, each streamed as it ends
    assert len(prompts[1]) > CHUNK
    before = computed_prompt_tokens(vllm_cluster)
    for prompt, want in zip(prompts, expected):
        tokens, fin = generate(vllm_cluster, token_request(prompt, allowed_jurisdictions=["CA-ON"]))
        assert tokens == want
        assert fin.placement.prefill_worker == TORONTO_P and fin.placement.decode_worker in TORONTO_D
        assert fin.placement.kv_bytes >= len(prompt) * p.kv_block_bytes // p.block_size
        assert fin.usage.cached_prompt_tokens == 0, "the decode worker's cache held none of it: all of it moved"
    after = computed_prompt_tokens(vllm_cluster)
    # the decode workers computed one token of each prompt (vLLM recomputes the last one), the prefill worker all
    computed = sum(after[d] - before[d] for d in TORONTO_D)
    assert computed == len(prompts), f"the decode workers computed {computed} prompt tokens"
    assert after[TORONTO_P] - before[TORONTO_P] == sum(map(len, prompts))


def test_a_disaggregated_request_on_vllm_pools_is_one_trace_across_three_processes(vllm_cluster, span_dir,
                                                                                  plumbing_model):
    prompt = [200 + (i * 31) % 20000 for i in range(200)]  # cached nowhere: all of it moves
    with vllm_cluster.channel() as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(token_request(
            prompt, request_id="vllm-trace", allowed_jurisdictions=["CA-ON"]), timeout=120))
    placement = msgs[-1].finish.placement
    assert placement.prefill_worker == TORONTO_P and placement.kv_bytes > 0, placement
    trace_id = placement.trace_id
    want = {"kvrelay.request", "kvrelay.attempt", "kvrelay.prefill", "kvrelay.prefill.chunk", "kvrelay.decode",
            "kvrelay.kv.send", "kvrelay.kv.receive", "kvrelay.decode.generate"}
    found: list[dict] = []

    def ready() -> bool:
        nonlocal found
        ids = {s["trace_id"] for s in read_spans(sorted(span_dir.glob("*.jsonl"))) if s["name"] == "kvrelay.request"
               and s["attributes"].get("kvrelay.request_id") == "vllm-trace"}
        found = [s for s in read_spans(sorted(span_dir.glob("*.jsonl"))) if s["trace_id"] in ids]
        return want <= {s["name"] for s in found}
    assert wait_until(ready, 30), sorted(s["name"] for s in found)
    assert {s["trace_id"] for s in found} == {trace_id}, found
    assert {s["service"] for s in found} == {"kvrelay-router", "kvrelay-prefill", "kvrelay-decode"}, found
    # chunked prefill: vLLM computed the 200 tokens in steps of at most the pool's budget
    chunks = [s["attributes"]["kvrelay.tokens"] for s in found if s["name"] == "kvrelay.prefill.chunk"]
    assert sum(chunks) == len(prompt) and max(chunks) <= CHUNK and len(chunks) >= 4, chunks
    send = next(s for s in found if s["name"] == "kvrelay.kv.send")
    recv = next(s for s in found if s["name"] == "kvrelay.kv.receive")
    assert send["attributes"]["kvrelay.kv.bytes"] == recv["attributes"]["kvrelay.kv.bytes"] > 0, (send, recv)
    layers = json.loads((plumbing_model / "config.json").read_text())["num_hidden_layers"]  # one event each
    sent = {e["attributes"]["kvrelay.layer"] for e in send["events"] if e["name"] == "layer"}
    assert sent == set(range(layers)), send


def test_logprobs_and_top_logprobs_come_from_vllm_per_token(vllm_cluster, references):
    """Greedy on a vLLM decode worker: each token is the first of its top 3 alternatives, with the
    token's own log-probability; the sampled token is not added when it ranks below them."""
    prompts, expected = references
    with vllm_cluster.channel() as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(token_request(
            prompts[0], allowed_jurisdictions=["CA-ON"], sampling=ipb.SamplingParams(logprobs=True, top_logprobs=3)),
            timeout=120))
    tokens = [t for m in msgs for t in m.token_ids]
    lps = [lp for m in msgs for lp in m.logprobs]
    tops = [t for m in msgs for t in m.top_logprobs]
    assert tokens == expected[0] and len(lps) == len(tops) == len(tokens)
    for tok, lp, top in zip(tokens, lps, tops):
        assert len(top.token_ids) == 3 and top.token_ids[0] == tok
        assert top.logprobs[0] == pytest.approx(lp, abs=1e-5)
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)


def test_a_request_pinned_to_a_jurisdiction_stays_there_and_never_meets_an_other_layout(vllm_cluster, references):
    """CA-QC has a vLLM decode pool and a builtin prefill pool: the request is computed where it
    decodes (the builtin pool's KV is not vLLM's), and never leaves Quebec."""
    prompts, expected = references
    before = computed_prompt_tokens(vllm_cluster)
    tokens, fin = generate(vllm_cluster, token_request(prompts[1], allowed_jurisdictions=["CA-QC"]))
    assert tokens == expected[1]
    assert fin.placement.decode_worker == MONTREAL_D and fin.placement.prefill_worker in ("", MONTREAL_D)
    assert fin.placement.decode_site == "montreal" and fin.placement.kv_bytes == 0
    after = computed_prompt_tokens(vllm_cluster)
    assert after[MONTREAL_P] == before[MONTREAL_P] and after[TORONTO_P] == before[TORONTO_P]
    for _ in range(4):  # unpinned: the builtin pool never prefills for a vLLM decode worker
        _, fin = generate(vllm_cluster, token_request(prompts[1], max_tokens=2))
        assert fin.placement.prefill_worker != MONTREAL_P
    assert computed_prompt_tokens(vllm_cluster)[MONTREAL_P] == before[MONTREAL_P]


def test_prefix_aware_placement_sends_a_repeated_prompt_to_the_worker_that_holds_it(vllm_cluster):
    """vLLM's prefix-cache events reach the router's index under kvrelay's block hashes."""
    prompt = [100 + (i * 7919) % 30000 for i in range(300)]  # two full vLLM blocks and a tail
    known = {w: s.cached_blocks for w, s in workers(vllm_cluster).items()}
    _, first = generate(vllm_cluster, token_request(prompt, max_tokens=2, allowed_jurisdictions=["CA-ON"]))
    holder = first.placement.decode_worker
    assert wait_until(lambda: workers(vllm_cluster)[holder].cached_blocks >= known[holder] + 256 // 16, 30), \
        "the router's prefix index never learned the decode worker's new blocks"
    for _ in range(3):
        _, again = generate(vllm_cluster, token_request(prompt, max_tokens=2, allowed_jurisdictions=["CA-ON"]))
        assert again.placement.decode_worker == holder
        assert again.usage.cached_prompt_tokens >= 256, "the decode worker's own cache served the prefix"


def _metrics(lc, worker_id: str) -> tuple[str, dict[str, float]]:
    """A worker's /metrics exposition, and each sample name's sum over its label sets."""
    url = f"http://{workers(lc)[worker_id].info.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return text, sums


WORKER_METRICS = {"kvrelay_kv_cache_usage_ratio", "kvrelay_prefix_cache_hit_ratio", "kvrelay_num_requests_running",
                  "kvrelay_num_requests_waiting", "kvrelay_prefill_tokens_per_second"}
"""What every worker's /metrics has, whatever its engine (as tests/integration/test_metrics.py asks of builtin ones)."""


def test_vllm_workers_export_kvrelays_metrics_and_count_what_moved(vllm_cluster):
    """The decode worker's KV counters grow by exactly the transfer the placement reports; the prefill
    worker's prefill rate is its vLLM engine's; promtool accepts both expositions (where installed)."""
    before = {d: _metrics(vllm_cluster, d)[1] for d in TORONTO_D}
    prompt = [400 + (i * 97) % 25000 for i in range(260)]  # cached nowhere: all of it moves
    _, fin = generate(vllm_cluster, token_request(prompt, max_tokens=4, allowed_jurisdictions=["CA-ON"]))
    assert fin.placement.prefill_worker == TORONTO_P and fin.placement.kv_bytes > 0, fin.placement
    d = fin.placement.decode_worker
    texts = {}
    for wid in (TORONTO_P, d):
        texts[wid], got = _metrics(vllm_cluster, wid)
        assert set(got) >= WORKER_METRICS, f"{wid} lacks {sorted(WORKER_METRICS - set(got))}"
        assert 0.0 <= got["kvrelay_kv_cache_usage_ratio"] <= 1.0
    prefill = _metrics(vllm_cluster, TORONTO_P)[1]
    assert prefill["kvrelay_prefill_tokens_per_second"] > 0
    after = _metrics(vllm_cluster, d)[1]
    moved = after["kvrelay_kv_transfer_bytes_total"] - before[d].get("kvrelay_kv_transfer_bytes_total", 0.0)
    assert moved == fin.placement.kv_bytes
    assert after["kvrelay_kv_transfer_seconds_count"] - before[d].get("kvrelay_kv_transfer_seconds_count", 0) == 1
    promtool = shutil.which("promtool")
    for wid, text in texts.items() if promtool else ():
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, f"promtool on {wid}'s /metrics: {check.stdout}{check.stderr}"


def test_cancel_frees_blocks_on_both_workers(vllm_cluster):
    with vllm_cluster.channel() as ch:
        stub = igrpc.InferenceStub(ch)
        call = stub.Generate(chat_request("Count slowly to a thousand. " * 20, max_tokens=1500, ignore_eos=True,
                                          allowed_jurisdictions=["CA-ON"]))
        first = next(iter(call))
        assert first.token_ids
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)

    def free() -> bool:
        loads = [worker_stats(vllm_cluster, w) for w in (TORONTO_P, *TORONTO_D)]
        return all(ld.running == 0 and ld.reservations == 0 and ld.free_blocks == ld.total_blocks
                   for ld in loads)
    deadline = time.monotonic() + 30
    while not free() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free(), [worker_stats(vllm_cluster, w) for w in (TORONTO_P, *TORONTO_D)]


@pytest.fixture(scope="module")
def faulty_cluster(plumbing_model):
    """One site, a vLLM prefill worker whose first transfer is tampered with, two vLLM decode workers;
    a killed worker stays dead."""
    raw = copy.deepcopy(CLUSTER_YAML)
    raw["sites"][0]["prefill"].update(VLLM_POOL)
    raw["sites"][0]["decode"].update(VLLM_POOL, replicas=2)
    raw["kv"] = {"transport": "tcp", "corrupt_first_transfers": 1}
    raw["router"]["liveness"] = {"heartbeat_interval_s": 0.25}
    with running_cluster(raw, plumbing_model, reconcile=False) as lc:
        assert wait_until(lambda: len(workers(lc)) == 3, 60)
        yield lc


def _all_free(lc, wid: str) -> bool:
    ld = worker_stats(lc, wid)
    return ld.running == 0 and ld.waiting == 0 and ld.reservations == 0 and ld.free_blocks == ld.total_blocks


def test_tampered_kv_is_refused_and_the_prompt_recomputed(faulty_cluster, references):
    """The prefill worker flips a sealed byte of its first transfer: the decode worker's AEAD
    check refuses it, vLLM frees the parked request's blocks, and the router recovers."""
    prompts, expected = references
    tokens, fin = generate(faulty_cluster, token_request(prompts[1]))
    assert tokens == expected[1]
    assert fin.placement.retries >= 1
    assert worker_stats(faulty_cluster, "local/prefill/0").kv_bytes_sent == 0  # the tampered one was never acked
    assert wait_until(lambda: all(_all_free(faulty_cluster, d) for d in ("local/decode/0", "local/decode/1")), 10)
    # the failed call made the router suspect the prefill worker until its next heartbeat
    assert wait_until(lambda: workers(faulty_cluster)["local/prefill/0"].healthy, 10)
    tokens, fin = generate(faulty_cluster, token_request(prompts[1]))
    assert tokens == expected[1] and fin.placement.retries == 0 and fin.placement.kv_bytes > 0


def test_a_decode_worker_killed_mid_stream_is_migrated(faulty_cluster, references):
    """The other decode worker computes the prompt and the tokens already sent; the client's
    stream is vLLM's uninterrupted greedy output, nothing duplicated or missing."""
    prompts, expected = references
    tokens, msgs, killed = stream_killing_its_decode_worker(faulty_cluster, token_request(prompts[0], LONG_TOKENS))
    assert killed is not None
    assert tokens == expected[-1]
    fin = msgs[-1].finish
    assert fin.placement.migrations == 1 and fin.placement.decode_worker != killed
    assert fin.usage.completion_tokens == LONG_TOKENS


@pytest.mark.slow  # 31 s, a cluster of its own; in CI: the builtin engine's death (test_failover.py), a vLLM
# decode worker killed mid-stream and migrated (above)
def test_a_vllm_engine_that_dies_takes_its_worker_out_and_the_request_recovers(plumbing_model, references):
    """local/decode/0's vLLM engine fails at its 6th step, mid-stream (fault injection: its step raises):
    the worker deregisters and exits non-zero, the launcher starts local/decode/1, and the stream,
    waiting for it, continues there as vLLM's uninterrupted greedy output."""
    prompts, expected = references
    raw = copy.deepcopy(CLUSTER_YAML)  # a builtin prefill pool: the vLLM decode workers compute their prompts
    raw["sites"][0]["decode"].update(VLLM_POOL)
    raw["workers"] |= {"fail_engine_worker": "local/decode/0", "fail_engine_at_step": 6}
    raw["router"] |= {"liveness": {"heartbeat_interval_s": 0.25}, "admission": {"unavailable_wait_s": 240.0}}
    with running_cluster(raw, plumbing_model) as lc, lc.channel() as ch:
        assert wait_until(lambda: len(workers(lc)) == 2, 60)
        msgs = list(igrpc.InferenceStub(ch).Generate(token_request(prompts[0], LONG_TOKENS), timeout=300))
        assert [t for m in msgs for t in m.token_ids] == expected[-1]
        fin = msgs[-1].finish
        assert fin.placement.decode_worker == "local/decode/1" and fin.placement.migrations == 1, fin.placement
        assert fin.usage.completion_tokens == LONG_TOKENS
        gone = [c for c in lc.left if c.name == "local/decode/0"]
        assert gone and gone[0].proc.poll() == 1
        assert "local/decode/0" not in workers(lc)


def _sliding_window_model(root, plumbing_model, window: int):
    """A seeded random Mistral whose every layer attends over the last ``window`` tokens (vLLM's
    SlidingWindowSpec: it frees the blocks behind the window), with SmolLM2's tokens."""
    folder = write_tiny_checkpoint(root / "swa", "mistral", seed=3, num_layers=2, hidden_size=128, num_heads=2,
                                   num_kv_heads=2, max_position_embeddings=4096, tokenizer_from=plumbing_model)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    return folder


def test_a_sliding_window_models_kv_moves_and_answers_as_the_decode_worker_computing_it(plumbing_model, tmp_path):
    """Prompts 5-11x the window: vLLM has freed the blocks behind it by the prompt's end, the connector moves
    the ones it holds, and the greedy answer is the one the same decode worker gives when it computes the
    prompt itself (its prefill pool gone; its prefix cache off, so nothing moved earlier is reused)."""
    model = _sliding_window_model(tmp_path, plumbing_model, window=64)
    raw = copy.deepcopy(CLUSTER_YAML)
    raw["sites"][0] |= {"prefill": dict(VLLM_POOL), "decode": {**VLLM_POOL, "vllm": {
        **VLLM_POOL["vllm"], "enable_prefix_caching": False}}}
    raw["router"] |= {"liveness": {"heartbeat_interval_s": 0.25, "worker_timeout_s": 2.0}}
    prompts = [[100 + (i * 37) % 5000 for i in range(n)] for n in (300, 700)]
    with running_cluster(raw, model, reconcile=False) as lc:
        moved = [generate(lc, token_request(p)) for p in prompts]
        assert all(not fin.placement.colocated and fin.placement.kv_bytes > 0 for _, fin in moved), moved
        prefill = next(c for c in lc.children if c.name == "local/prefill/0")
        prefill.proc.kill()
        prefill.proc.wait(30)
        assert wait_until(lambda: not getattr(workers(lc).get("local/prefill/0"), "healthy", False), 30, 0.1)
        computed = [generate(lc, token_request(p)) for p in prompts]
    assert all(fin.placement.colocated for _, fin in computed), computed
    assert [tokens for tokens, _ in moved] == [tokens for tokens, _ in computed]

