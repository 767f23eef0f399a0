"""The embedded default model, SmolLM2-135M-Instruct: the GGUF conversion
agrees with transformers' own GGUF loader, and greedy generation is
token-identical to transformers' ``generate`` (fp32)."""

from __future__ import annotations

import functools

import pytest
import torch

from kvrelay.engine.default_model import embedded_gguf, prepare_default_model
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.model

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a network router does, in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
]


def test_prepare_reuses_folder(smollm_path):
    before = (smollm_path / "model.safetensors").stat().st_mtime_ns
    again = prepare_default_model(smollm_path.parent.parent)
    assert again == smollm_path
    assert (smollm_path / "model.safetensors").stat().st_mtime_ns == before


@pytest.fixture
def memoised_gguf(monkeypatch):
    """transformers rebuilds gguf's (pure) tensor-name map once per module of the model (397
    times, 6 s of the load), and parses the file again for its config, its tensors and its
    tokenizer (gguf-py reads the 49k-token vocabulary field by field: ~7 s each); the reference
    it loads is the same when the map is built once and the (read-only) file parsed once."""
    gguf_py = pytest.importorskip("gguf")
    monkeypatch.setattr(gguf_py, "get_tensor_name_map", functools.lru_cache(gguf_py.get_tensor_name_map))
    monkeypatch.setattr(gguf_py, "GGUFReader", functools.lru_cache(gguf_py.GGUFReader))


def test_conversion_matches_transformers_gguf_loader(smollm_path, memoised_gguf):
    gguf = embedded_gguf()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).state_dict()
    from safetensors.torch import load_file
    ours = load_file(str(smollm_path / "model.safetensors"))
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name
    ref_tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = Tokenizer(smollm_path)
    for text in ["Hello, world!", "1234567 + 89 = ?", "  leading spaces\tand\ttabs\n",
                 "<|im_start|>user\nhi<|im_end|>", "naïve café — 東京 🚀", "def f(x):\n    return x**2"]:
        assert tok.encode(text) == ref_tok.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def _greedy_matches_transformers(smollm_path, make_engine, chats: list[str]) -> list:
    eng = make_engine(smollm_path, num_blocks=512)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32)
    ref_tok = transformers.AutoTokenizer.from_pretrained(smollm_path)
    prompts = []
    for text in chats:
        msgs = [{"role": "user", "content": text}]
        ids = eng.tokenizer.encode_chat(msgs)
        ref_ids = ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if not isinstance(ref_ids, list):
            ref_ids = ref_ids["input_ids"]
        assert ids == list(ref_ids), "chat template renders differently from transformers"
        prompts.append(ids)
    outs = eng.generate(prompts, SamplingParams(max_tokens=32))
    for ids, out in zip(prompts, outs):
        x = torch.tensor([ids])
        with torch.no_grad():  # the mask must be explicit: the prompt contains the pad id (<|im_end|>)
            ref = ref_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False)
        assert out.token_ids == ref[0, len(ids):].tolist(), eng.tokenizer.decode(ids)
        assert len(out.token_ids) == 32 or out.finish_reason == "stop"
    return outs


def test_greedy_generation_matches_transformers(smollm_path, make_engine):
    """Three of the chats, batched in our engine, each against transformers' own generate."""
    outs = _greedy_matches_transformers(smollm_path, make_engine, CHATS[:3])
    assert "Paris" in outs[0].text


@pytest.mark.slow
def test_greedy_generation_matches_transformers_on_the_other_chats(smollm_path, make_engine):
    _greedy_matches_transformers(smollm_path, make_engine, CHATS[3:])
