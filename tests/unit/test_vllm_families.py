"""Which of vLLM's KV caches the connector moves (runtime/vllm_families.py): decided from the
class names of vLLM's KV cache specs, one per group, checked here against vLLM's own source."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvrelay.runtime.vllm_families import MOVED, REFUSED, refusal


@pytest.mark.parametrize("specs", [["FullAttentionSpec"], ["SlidingWindowSpec"]])
def test_one_group_of_full_or_sliding_window_attention_is_moved(specs):
    assert refusal("m", specs) is None


@pytest.mark.parametrize("specs,named", [
    (["MLAAttentionSpec"], "multi-head latent attention (MLA"),
    (["FullAttentionSpec", "MambaSpec"], "state-space (Mamba) layers"),
    (["ChunkedLocalAttentionSpec"], "chunked local attention on every layer"),
    (["CrossAttentionSpec"], "cross-attention"),
    (["FullAttentionSpec", "FullAttentionSpec"], "2 separate KV cache groups"),
    (["SinkFullAttentionSpec"], "vLLM's SinkFullAttentionSpec"),  # a subclass of FullAttentionSpec: not moved
    (["SomeSpecOfALaterVllm"], "vLLM's SomeSpecOfALaterVllm"),
    ([], "no KV cache group"),
])
def test_anything_else_is_refused_naming_the_model_and_what_its_cache_has(specs, named):
    why = refusal("deepseek-v2-lite", specs)
    assert why is not None and why.startswith("deepseek-v2-lite: ") and named in why, why
    assert "engine/VLLM.md" in why


def test_the_spec_names_are_vllms():
    """A rename in vLLM would make a refused spec look unknown (still refused) and a moved one refused:
    the names must be the classes vLLM defines (read from its source, without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (make vllm)")
    source = (Path(spec.origin).parent / "v1" / "kv_cache_interface.py").read_text()
    for name in [*MOVED, *REFUSED]:
        assert f"\nclass {name}(" in source, name
