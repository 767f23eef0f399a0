"""CUDA paths (skipped without a GPU): bf16/fp16 parity with transformers.

Tolerance: bf16 keeps 8 significand bits (relative step 2^-8 ~ 0.4%), and
both implementations round after every matmul and norm of ~30 layers in a
different order, so logits of magnitude ~30 differ by up to a few tenths.
We bound the max abs difference at 0.5 (fp16: 0.1, 11 significand bits)
and require the greedy (top-1) choice to agree at >= 97% of positions;
exact greedy text can then differ only after a near-tie.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

TOLERANCE = {"bfloat16": 0.5, "float16": 0.1}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "mistral"])
def test_tiny_parity_cuda(arch, dtype, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    eng = make_engine(path, dtype=dtype, device="cuda")
    ours, _ = eng.prompt_logits(ids)
    ours = ours.cpu()
    assert (ours - ref).abs().max().item() < TOLERANCE[dtype]
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.97


@pytest.mark.model
def test_smollm_bf16_cuda_generation(smollm_path, make_engine):
    eng = make_engine(smollm_path, dtype="bfloat16", device="cuda", num_blocks=512)
    ids = eng.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = eng.generate([ids], SamplingParams(max_tokens=16))[0]
    assert "Paris" in out.text
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids + out.token_ids], device="cuda")).logits[0].float().cpu()
    ours, _ = make_engine(smollm_path, dtype="bfloat16", device="cuda", num_blocks=512,
                          prefix_caching=False).prompt_logits(ids + out.token_ids)
    assert (ours.cpu() - ref).abs().max().item() < 1.0
