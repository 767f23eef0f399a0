"""Converts a Llama-architecture GGUF file (such as the embedded default
model, SmolLM2-135M-Instruct) into a Hugging Face style checkpoint folder:
config.json, model.safetensors (fp32, dequantized), tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json.

llama.cpp stores the q/k projections with rows permuted for its rotary
kernel; they are permuted back here, so the folder is an ordinary Hugging
Face Llama checkpoint that any Llama implementation reads the same way.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file  # the same file as torch's writer, without importing torch (3 s)
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from kvrelay.engine.errors import CheckpointError

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's rotary row permutation of q/k weights."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_name(gguf_name: str) -> str | None:
    base = gguf_name.removesuffix(".weight").removesuffix(".bias")
    suffix = gguf_name[len(base):]
    if base == "token_embd":
        return "model.embed_tokens" + suffix
    if base == "output_norm":
        return "model.norm" + suffix
    if base == "output":
        return "lm_head" + suffix
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}{suffix}"
    return None


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge ``"a b"`` as the pair BPE takes."""
    a, sep, b = merge.partition(" ")
    if not sep:
        raise CheckpointError(f"GGUF tokenizer merge {merge!r} is not two tokens")
    return a, b


def _tokenizer_json(tokens: list[str], merges: list[str], types: list[int], pre: str) -> str:

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default", ""):
        tok.pre_tokenizer = byte_level
    else:
        raise CheckpointError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported by the converter")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    tok.add_special_tokens(special)
    return tok.to_str()


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Writes a checkpoint folder for ``gguf_path`` at ``out_dir`` (atomically)."""

    reader = _open_llama_gguf(gguf_path)
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    weights = _hf_weights(reader, n_head, n_kv)
    config = _hf_config(reader, tokens, n_head, n_kv, tied="lm_head.weight" not in weights)
    tok_cfg = _tokenizer_config(reader, tokens, config)
    tok_json = _tokenizer_json(tokens, list(_field(reader, "tokenizer.ggml.merges")),
                               list(_field(reader, "tokenizer.ggml.token_type")),
                               _field(reader, "tokenizer.ggml.pre", "default"))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"]}
    _write_checkpoint(out_dir, weights, {"config.json": json.dumps(config, indent=2), "tokenizer.json": tok_json,
                                         "tokenizer_config.json": json.dumps(tok_cfg, indent=2),
                                         "generation_config.json": json.dumps(generation, indent=2)})
    return out_dir


def _open_llama_gguf(gguf_path: Path) -> GGUFReader:
    """The reader of a Llama GGUF file with a byte-level BPE tokenizer; CheckpointError otherwise."""
    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{gguf_path}: cannot read GGUF file ({exc})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise CheckpointError(f"{gguf_path}: only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    return reader


def _hf_weights(reader: GGUFReader, n_head: int, n_kv: int) -> dict[str, np.ndarray]:
    """Dequantized float32 tensors under Hugging Face names, q/k in HF's rotary layout."""
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        weights[name] = np.ascontiguousarray(w)
    return weights


def _hf_config(reader: GGUFReader, tokens: list, n_head: int, n_kv: int, tied: bool) -> dict:
    """config.json of the checkpoint."""
    hidden = int(_field(reader, "llama.embedding_length"))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 2))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": eos,
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": "float32",
    }


def _tokenizer_config(reader: GGUFReader, tokens: list, config: dict) -> dict:
    """tokenizer_config.json of the checkpoint (special tokens, chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[config["bos_token_id"]],
        "eos_token": tokens[config["eos_token_id"]],
        "pad_token": tokens[int(config["pad_token_id"])],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
    }


def _write_checkpoint(out_dir: Path, weights: dict[str, np.ndarray], files: dict[str, str]) -> None:
    """Writes the weights and the text ``files`` into a temporary folder beside
    ``out_dir``, then puts it in place of ``out_dir`` (removed on failure)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, text in files.items():
            (tmp / name).write_text(text)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
