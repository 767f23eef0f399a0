"""Small seeded random checkpoints of each supported architecture, for tests.

The tokenizer is byte-level (256 byte tokens, no merges) plus ChatML special
tokens, so any text round-trips and chat templates work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvrelay.engine.checkpoint import expected_shapes
from kvrelay.engine.config import ModelConfig

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_ARCHS: dict[str, dict] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0,
              "tie_word_embeddings": False, "attention_bias": False},
    "llama3": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
               "tie_word_embeddings": False, "attention_bias": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "use_sliding_window": False},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "rope_theta": 10000.0,
                "tie_word_embeddings": False, "sliding_window": None},
}
TINY_ARCHS = tuple(_ARCHS)


def _tokenizer_json() -> str:

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str()


def write_tiny_checkpoint(out: Path, arch: str = "llama", seed: int = 0, num_layers: int = 3,
                          hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                          max_position_embeddings: int = 1024, tokenizer_from: Path | None = None) -> Path:
    """Writes a random ``arch`` checkpoint folder at ``out`` and returns it.

    With ``tokenizer_from`` (a checkpoint folder), the tokenizer, its special
    token ids and its vocabulary size are that checkpoint's: a model that reads
    and writes the same tokens as the real one at a small fraction of its cost.
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos = 320, 256 + SPECIAL_TOKENS.index("<|im_start|>"), 256 + SPECIAL_TOKENS.index("<|im_end|>")
    if tokenizer_from is not None:
        source = json.loads((Path(tokenizer_from) / "config.json").read_text())
        vocab, bos, eos = source["vocab_size"], source["bos_token_id"], source["eos_token_id"]
    config = {
        **_ARCHS[arch],
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    cfg = ModelConfig.from_dict(config)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight" or name == "lm_head.weight":
            weights[name] = torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(tokenizer_from) / name, out / name)
    else:
        (out / "tokenizer.json").write_text(_tokenizer_json())
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
            "chat_template": CHAT_TEMPLATE, "model_max_length": max_position_embeddings}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out
