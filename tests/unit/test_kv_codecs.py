"""KV codecs (kvtransfer/codecs.py) on a real model's KV: SmolLM2's cache
after a prefill of real text, every layer's K and V planes of the blocks the
prompt filled. Each codec's round trip stays within its stated bound per
element, and the sizes meet issue 35's ratios (deterministic: bytes, not time)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.benchmarks import codec_quality
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.base import KVCodec
from kvrelay.kvtransfer.codecs import (
    FP8_SUBNORMAL_STEP,
    INT4_GROUP,
    SCALE_BLOCKS,
    decode,
    encode,
    encoded_bytes,
)

pytestmark = pytest.mark.model

TEXT = ("Research and education networks connect universities, laboratories and hospitals across cities and "
        "countries. They carry physics data, genomes, climate models and lecture videos. ") * 6


@pytest.fixture(scope="module")
def real_kv(smollm_path) -> torch.Tensor:
    """[layers * 2 planes * blocks, tokens, heads, head_dim] of SmolLM2's KV for TEXT, float32."""
    from kvrelay.engine.config import CacheConfig, EngineConfig
    from kvrelay.engine.llm_engine import LLMEngine
    eng = LLMEngine(EngineConfig(model_path=smollm_path, cache=CacheConfig(block_size=16, num_blocks=64)))
    prompt = eng.tokenizer.encode(TEXT)
    eng.generate([prompt], SamplingParams(max_tokens=1))
    kv = eng.cache.kv  # [layers, 2, blocks, tokens, heads, dim]
    full = [b for b in range(kv.shape[2]) if kv[:, :, b].abs().sum(dim=(0, 1, 3, 4)).ne(0).all()]
    assert len(full) >= len(prompt) // 16 - 1, "the prefill filled fewer blocks than the prompt has"
    return kv[:, :, full].flatten(0, 2).float().clone()


def _per_block(scales: torch.Tensor, blocks: int) -> torch.Tensor:
    """[groups, heads, head_dim] scales as [blocks, 1, heads, head_dim]: each block's group's."""
    return scales.repeat_interleave(SCALE_BLOCKS, dim=0)[:blocks, None]


def test_int8_is_within_half_a_step_of_its_channel_scale(real_kv):
    run = real_kv[:8 * SCALE_BLOCKS + 3]  # a last group shorter than the others
    enc = encode(KVCodec.INT8, run)
    err = (decode(enc, torch.float32) - run).abs()
    step = _per_block(enc.scales, run.shape[0])
    assert torch.all(err <= step / 2 * (1 + 1e-5) + 1e-12)
    assert enc.scales.shape == (9, run.shape[2], run.shape[3])
    # a group's scale is its own amax / 127, per head and channel: no other group's outliers reach it
    first = run[:SCALE_BLOCKS].abs().amax(dim=(0, 1))
    assert torch.allclose(enc.scales[0], torch.where(first > 0, first / 127, torch.ones_like(first)))


def test_fp8_is_within_its_mantissa_and_subnormal_bounds(real_kv):
    enc = encode(KVCodec.FP8, real_kv)
    err = (decode(enc, torch.float32) - real_kv).abs()
    scale = _per_block(enc.scales, real_kv.shape[0])
    bound = real_kv.abs() * 2.0 ** -4 + scale * FP8_SUBNORMAL_STEP / 2
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-12)


def test_int4_is_within_half_a_step_of_its_group_scale(real_kv):
    enc = encode(KVCodec.INT4, real_kv)
    got = decode(enc, torch.float32)
    b, t, h, d = real_kv.shape
    step = enc.scales.float().repeat_interleave(INT4_GROUP, dim=-1).view(b, t, h, d)
    assert torch.all((got - real_kv).abs() <= step / 2 * (1 + 1e-3) + 1e-12)
    assert torch.all(step <= real_kv.abs().view(b, t, h, d // INT4_GROUP, INT4_GROUP).amax(-1)
                     .repeat_interleave(INT4_GROUP, dim=-1) / 7 * (1 + 1e-3) + 1e-30)


@pytest.mark.parametrize("codec", [KVCodec.INT8, KVCodec.FP8, KVCodec.INT4])
def test_decoding_into_the_receivers_dtype_and_the_sizes_counted(codec, real_kv):
    run = real_kv[:8].to(torch.bfloat16)
    enc = encode(codec, run)
    assert decode(enc, torch.bfloat16).dtype == torch.bfloat16
    assert enc.nbytes == encoded_bytes(codec, tuple(run.shape), 2)


def test_the_ratios_issue_35_asks_for():
    shape = (64, 16, 3, 64)  # SmolLM2's blocks: 16 tokens, 3 KV heads of 64
    bf16, fp32 = encoded_bytes(KVCodec.NONE, shape, 2), encoded_bytes(KVCodec.NONE, shape, 4)
    assert bf16 / encoded_bytes(KVCodec.INT8, shape, 2) >= 1.9 and fp32 / encoded_bytes(KVCodec.INT8, shape, 4) >= 3.8
    assert bf16 / encoded_bytes(KVCodec.INT4, shape, 2) >= 3.5


def test_zeros_and_bad_shapes():
    zeros = torch.zeros(2, 16, 3, 64)
    for codec in (KVCodec.INT8, KVCodec.FP8, KVCodec.INT4):
        assert torch.equal(decode(encode(codec, zeros), torch.float32), zeros)
    with pytest.raises(ValueError, match=r"\[blocks, tokens, heads, head_dim\]"):
        encode(KVCodec.INT8, torch.zeros(16, 64))
    with pytest.raises(ValueError, match="int4 needs head_dim a multiple of 32, got 48"):
        encode(KVCodec.INT4, torch.zeros(1, 16, 3, 48))
    with pytest.raises(ValueError, match="'zstd' is not a valid KVCodec"):
        KVCodec("zstd")


SMALL = codec_quality.QualitySetup(prefix_tokens=64, suffix_tokens=64, windows=2, prompts=2, greedy_tokens=8)


@pytest.fixture(scope="module")
def quality(smollm_path) -> dict:
    """`kvrelay bench kv-codec`'s quality figures on SmolLM2, on a small slice of its text."""
    return codec_quality.run(smollm_path, SMALL, codecs=(KVCodec.INT8, KVCodec.INT4))["codecs"]


def test_quality_without_a_codec_is_the_reference_exactly(quality):
    """codec none passes nothing through: the same perplexity and every token the same."""
    none = quality["none"]
    assert none["perplexity_delta_pct"] == 0.0 and none["top1_agreement"] == 1.0 and none["greedy_agreement"] == 1.0
    assert 1.0 < none["perplexity"] < 100.0  # real prose under a real model, not noise (vocabulary 49152)


def test_quality_sees_the_codecs_loss(quality):
    """The prompt's KV really goes through each codec before the model continues from it: int4's
    coarser steps move the perplexity and more than int8's do; neither destroys the text."""
    int8, int4 = quality["int8"], quality["int4"]
    assert int4["perplexity_delta_pct"] != 0.0
    assert abs(int4["perplexity_delta_pct"]) > abs(int8["perplexity_delta_pct"])
    assert abs(int8["perplexity_delta_pct"]) < 5.0 and abs(int4["perplexity_delta_pct"]) < 25.0
    assert int8["top1_agreement"] >= 0.8 and int4["top1_agreement"] >= 0.6


def test_quality_refuses_a_prefix_of_partial_blocks(smollm_path):
    with pytest.raises(ValueError, match="prefix_tokens must be a positive multiple of 16"):
        codec_quality.run(smollm_path, codec_quality.QualitySetup(prefix_tokens=40))
