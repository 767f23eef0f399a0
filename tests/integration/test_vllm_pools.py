"""Pools that run vLLM (issue 34): a real cluster whose prefill and decode
workers each run vLLM's engine (the CPU build `make test` installs), with
kvrelay's connector moving the KV over its sealed TCP transport.

One module-scoped cluster (vLLM engines take seconds to start) on the
plumbing model: what is asserted is who computes what, what moves and what
is freed, and that the answer is vLLM's own. The reference is vLLM alone
(``vllm.LLM``, greedy) in a child process, on the same prompt tokens."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time

import grpc
import pytest

from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.runtime.engines import vllm_installed
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import CLUSTER_YAML, chat_request, collect, running_cluster, worker_stats, workers

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make vllm)")]

VLLM_POOL = {"engine": "vllm", "vllm": {"max_model_len": 2048, "kv_cache_memory_gib": 0.25}}
TEXTS = ["Hello there, how are you?", "Tell me about Toronto and its winters. " * 12]
MAX_TOKENS = 12

_ALONE = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
import vllm
from vllm.inputs import TokensPrompt
args = json.loads(sys.argv[1])
llm = vllm.LLM(model=args["model"], dtype="float32", enforce_eager=True, max_model_len=2048,
               kv_cache_memory_bytes=1 << 28, seed=0)
sp = vllm.SamplingParams(max_tokens=args["max_tokens"], temperature=0.0)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in args["prompts"]], sp, use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def vllm_alone(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of vLLM alone (its offline engine) for ``prompts``."""
    arg = json.dumps({"model": str(model), "prompts": prompts, "max_tokens": max_tokens})
    proc = subprocess.run([sys.executable, "-c", _ALONE, arg], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def vllm_cluster(plumbing_model):
    raw = copy.deepcopy(CLUSTER_YAML)
    raw["sites"][0]["prefill"].update(VLLM_POOL)
    raw["sites"][0]["decode"].update(VLLM_POOL)
    with running_cluster(raw, plumbing_model) as lc:
        yield lc


@pytest.fixture(scope="module")
def references(plumbing_model):
    tok = Tokenizer(plumbing_model)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]
    return prompts, vllm_alone(plumbing_model, prompts, MAX_TOKENS)


def test_disaggregated_answer_is_vllms_and_the_prompt_was_moved(vllm_cluster, references):
    prompts, expected = references
    ws = workers(vllm_cluster)
    p, d = ws["local/prefill/0"].info, ws["local/decode/0"].info
    assert p.layout_hash == d.layout_hash and p.block_size == 128, "vLLM pools register vLLM's layout"
    before = worker_stats(vllm_cluster, "local/decode/0")
    with vllm_cluster.channel() as ch:
        stub = igrpc.InferenceStub(ch)
        for text, prompt, want in zip(TEXTS, prompts, expected):
            tokens, msgs = collect(stub, chat_request(text, max_tokens=MAX_TOKENS))
            assert tokens == want, text
            placement = msgs[-1].finish.placement
            assert (placement.prefill_worker, placement.decode_worker) == ("local/prefill/0", "local/decode/0")
            assert placement.kv_bytes >= len(prompt) * p.kv_block_bytes // p.block_size
    after = worker_stats(vllm_cluster, "local/decode/0")
    # the decode worker computed one token of each prompt (vLLM recomputes the last one) and the outputs
    computed = after.prefill_tokens_total - before.prefill_tokens_total
    assert computed == len(TEXTS), f"the decode worker computed {computed} prompt tokens"
    assert after.kv_bytes_received - before.kv_bytes_received > 0


def test_cancel_frees_blocks_on_both_workers(vllm_cluster):
    with vllm_cluster.channel() as ch:
        stub = igrpc.InferenceStub(ch)
        call = stub.Generate(chat_request("Count slowly to a thousand. " * 20, max_tokens=1500, ignore_eos=True))
        first = next(iter(call))
        assert first.token_ids
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)

    def free() -> bool:
        loads = [worker_stats(vllm_cluster, w) for w in ("local/prefill/0", "local/decode/0")]
        return all(ld.running == 0 and ld.reservations == 0 and ld.free_blocks == ld.total_blocks
                   for ld in loads)
    deadline = time.monotonic() + 30
    while not free() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free(), [worker_stats(vllm_cluster, w) for w in ("local/prefill/0", "local/decode/0")]
