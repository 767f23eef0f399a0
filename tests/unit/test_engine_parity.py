"""Logit parity with the transformers reference implementation on tiny random
checkpoints of every supported architecture, with and without a cached
prefix and with chunked prefill."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def reference_logits(path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "mistral"])
def test_logits_match_reference(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    ids = prompt(300, 1)  # beyond llama3's original 256 positions: scaling matters
    ref = reference_logits(path, ids)
    eng = make_engine(path)
    ours, cached = eng.prompt_logits(ids)
    assert cached == 0
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_reference_with_cached_prefix(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    shared = prompt(70, 2)
    first, second = shared + prompt(20, 3), shared + prompt(33, 4)
    eng = make_engine(path)
    eng.prompt_logits(first)
    ours, cached = eng.prompt_logits(second)
    assert cached == 64  # 4 full blocks of 16 of the shared 70 tokens
    ref = reference_logits(path, second)[cached:]
    assert (ours - ref).abs().max().item() < TOL


def test_chunked_prefill_matches_reference(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["mistral"]
    ids = prompt(150, 5)
    eng = make_engine(path, max_batched=40)  # 150 tokens in chunks of 40
    ours, _ = eng.prompt_logits(ids)
    ref = reference_logits(path, ids)
    assert (ours - ref).abs().max().item() < TOL
