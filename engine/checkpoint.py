"""Loading Hugging Face style checkpoint folders: ``config.json``,
``*.safetensors`` (memory-mapped, optionally sharded with an index),
``tokenizer.json`` and the chat template. Nothing here touches the network.

Every problem (missing or truncated file, unknown architecture, a tensor
missing or of the wrong shape) is a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvrelay.engine.config import ModelConfig
from kvrelay.engine.errors import CheckpointError


@dataclass(slots=True)
class Checkpoint:
    """A validated checkpoint folder."""

    path: Path
    config: ModelConfig
    weight_files: list[Path]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) from the memory-mapped safetensors files."""
        for f in self.weight_files:
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                        yield name, st.get_tensor(name)
            except SafetensorError as exc:
                raise CheckpointError(f"{f}: unreadable safetensors file ({exc})") from None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Llama-family checkpoint must hold, with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: invalid safetensors index ({exc})") from None
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: weight file named in the index is missing")
    return files


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Validates a checkpoint folder without loading its weights into memory.

    Checks that config.json describes a supported architecture, that every
    weight file opens (a truncated file is caught here) and that every
    expected tensor is present with the expected shape.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint folder does not exist")
    cfg = ModelConfig.from_file(path / "config.json", name=path.name)
    files = _weight_files(path)
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    found[name] = tuple(st.get_slice(name).get_shape())
        except SafetensorError as exc:
            raise CheckpointError(f"{f}: unreadable or truncated safetensors file ({exc})") from None
        except OSError as exc:
            raise CheckpointError(f"{f}: cannot read ({exc})") from None
    for name, shape in expected_shapes(cfg).items():
        if name not in found:
            raise CheckpointError(f"{path}: tensor {name} is missing")
        if found[name] != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {list(found[name])}, "
                                  f"config.json implies {list(shape)}")
    return Checkpoint(path=path, config=cfg, weight_files=files)
