"""Bad checkpoints and bad requests raise clear errors naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.engine.checkpoint import load_checkpoint
from kvrelay.engine.config import CacheConfig, EngineConfig
from kvrelay.engine.errors import CheckpointError, InvalidRequestError
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams


@pytest.fixture
def ckpt(tmp_path, tiny_checkpoints):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["llama"], dst)
    return dst


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown architecture 'GPTNeoXForCausalLM'"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("name,match", [("config.json", "config.json not found"),
                                        ("model.safetensors", "no \\*.safetensors"),
                                        ("tokenizer.json", "tokenizer.json not found")])
def test_missing_file(ckpt, name, match):
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=match):
        LLMEngine(EngineConfig(model_path=ckpt, cache=CacheConfig(num_blocks=16)))


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_truncated_weights(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: unreadable or truncated"):
        load_checkpoint(ckpt)


def test_tensor_shape_mismatch(ckpt):
    w = load_file(str(ckpt / "model.safetensors"))
    w["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(w, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj.weight has shape \[7, 64\]"):
        load_checkpoint(ckpt)


def test_missing_tensor(ckpt):
    w = load_file(str(ckpt / "model.safetensors"))
    del w["model.layers.2.self_attn.k_proj.weight"]
    save_file(w, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.layers.2.self_attn.k_proj.weight is missing"):
        load_checkpoint(ckpt)


def test_bad_config_values(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a multiple of num_key_value_heads"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(ckpt)


def test_bad_requests(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"])  # context window 1024
    ok = SamplingParams(max_tokens=8)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        eng.add_request("a", [], ok)
    with pytest.raises(InvalidRequestError, match="context window is 1024"):
        eng.add_request("b", [1] * 1024, ok)
    with pytest.raises(InvalidRequestError, match=r"max_tokens \(1000\) exceeds the context window"):
        eng.add_request("c", [1] * 100, SamplingParams(max_tokens=1000))
    with pytest.raises(InvalidRequestError, match=r"token ids must be in \[0, 320\)"):
        eng.add_request("d", [1, 99999], ok)
    small = make_engine(tiny_checkpoints["llama"], num_blocks=4)
    with pytest.raises(InvalidRequestError, match="exceeds this worker's KV cache"):
        small.add_request("e", [1] * 60, ok)
    eng.add_request("f", [1, 2, 3], ok)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("f", [1, 2, 3], ok)
    eng.abort_request("f")


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"seed": -1}, "seed"), ({"stop": ["x"] * 10_000}, "at most 16 stop strings"),
    ({"stop": [""]}, "non-empty"), ({"stop": ["y" * 1000]}, "limit is 256"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_engine_config_validation(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model_path=tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="float16 is only supported on CUDA"):
        EngineConfig(model_path=tmp_path, dtype="float16")
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=12)
