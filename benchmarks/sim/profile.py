"""Performance profiles: how long one engine step takes, for the simulator.

A step computes ``prefill_tokens`` prompt tokens (chunks of one or more
prompts) and one token for each of ``decode_seqs`` running sequences;
``prefill_pairs`` counts the (query, key) pairs of the chunks' attention and
``decode_context`` the KV tokens the decoding sequences attend to. Two kinds
of profile give its time:

- ``MeasuredProfile``: a linear fit of steps timed on a real engine
  (``kvrelay profile``), ``t = c0 + c_prefill x prefill_tokens + c_decode x
  decode_seqs + c_attend x prefill_pairs + c_context x decode_context``,
  with the machine and settings it was measured under;
- ``AnalyticProfile``: a data-centre GPU from its datasheet (peak dense
  FLOPS, HBM bandwidth, memory) running a named model, with stated
  efficiencies: ``t = max(FLOPs / (peak x compute_eff), bytes / (bandwidth
  x memory_eff)) + step_overhead``; its KV capacity is what the memory
  leaves after the weights.

Every profile names its source.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
"""Bytes per weight and per KV element."""


class ProfileError(ValueError):
    """A profile name or file is unknown or malformed; the message says which field."""


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """The shape of a model, enough to cost its steps and size its KV."""

    name: str
    params: float
    """Parameters (weights read once per step)."""
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    max_context: int = 131072

    def kv_bytes_per_token(self, dtype: str) -> int:
        """KV bytes of one token over all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


MODELS = {m.name: m for m in (
    ModelSpec("smollm2-135m", 134.5e6, 30, 576, 3, 64, 8192),
    ModelSpec("llama-3.1-8b", 8.03e9, 32, 4096, 8, 128),
    ModelSpec("llama-3.1-70b", 70.6e9, 80, 8192, 8, 128),
    ModelSpec("qwen2.5-32b", 32.8e9, 64, 5120, 8, 128),
)}
"""Built-in model shapes (from each model's config.json on its model card)."""


@dataclass(slots=True, frozen=True)
class GpuSpec:
    """A data-centre accelerator, from its vendor's datasheet (SXM parts)."""

    name: str
    bf16_tflops: float
    """Peak dense BF16 tensor TFLOPS (no sparsity)."""
    fp8_tflops: float
    """Peak dense FP8 TFLOPS (0: no FP8 tensor cores)."""
    hbm_tbps: float
    memory_gb: float
    source: str


GPUS = {g.name: g for g in (
    GpuSpec("a100", 312, 0, 2.039, 80, "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS BF16 dense, 2,039 GB/s"),
    GpuSpec("h100", 989, 1979, 3.35, 80, "NVIDIA H100 datasheet (SXM5): 989 TFLOPS BF16 / 1,979 FP8 dense, 3.35 TB/s"),
    GpuSpec("h200", 989, 1979, 4.8, 141, "NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 / 1,979 FP8 dense, 4.8 TB/s"),
    GpuSpec("b200", 2250, 4500, 8.0, 180, "NVIDIA HGX B200 datasheet: 2.25 PFLOPS BF16 / 4.5 FP8 dense, 8 TB/s"),
)}


def attention_pairs(start: int, n: int) -> int:
    """(query, key) pairs of computing tokens [start, start + n) of one sequence (causal)."""
    return n * start + n * (n + 1) // 2


class Profile(Protocol):
    """What the simulator asks of a profile."""

    source: str
    dtype: str
    model: ModelSpec

    def step_s(self, prefill_tokens: int, decode_seqs: int, prefill_pairs: int, decode_context: int) -> float:
        """Seconds one engine step takes."""

    def kv_capacity_tokens(self) -> int | None:
        """KV tokens one worker holds (None: from the cluster config's cache section)."""

    def describe(self) -> dict:
        """The profile as the report records it."""


@dataclass(slots=True)
class MeasuredProfile:
    """A linear fit of real engine steps (``kvrelay profile``)."""

    model: ModelSpec
    dtype: str
    c0: float
    """Seconds of every step (scheduling, sampling, Python)."""
    c_prefill: float
    """Seconds per prompt token."""
    c_decode: float
    """Seconds per decoded sequence."""
    c_attend: float
    """Seconds per (query, key) attention pair of a prompt chunk."""
    c_context: float
    """Seconds per KV token a decoding sequence attends to (read from the paged cache)."""
    source: str = ""
    machine: dict = field(default_factory=dict)
    """CPU model and flags, threads: where it was measured."""
    fit: dict = field(default_factory=dict)
    """Points and relative error of the fit."""

    def step_s(self, prefill_tokens: int, decode_seqs: int, prefill_pairs: int, decode_context: int) -> float:
        return (self.c0 + self.c_prefill * prefill_tokens + self.c_decode * decode_seqs
                + self.c_attend * prefill_pairs + self.c_context * decode_context)

    def kv_capacity_tokens(self) -> int | None:
        return None

    def describe(self) -> dict:
        return {"kind": "measured", **asdict(self)}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.describe(), indent=1) + "\n")


@dataclass(slots=True)
class AnalyticProfile:
    """A GPU from its datasheet running ``model`` (roofline with stated efficiencies)."""

    gpu: GpuSpec
    model: ModelSpec
    dtype: str = "bfloat16"
    compute_eff: float = 0.5
    """Share of peak FLOPS a step reaches (prefill is compute-bound)."""
    memory_eff: float = 0.8
    """Share of HBM bandwidth a step reaches (decode is bandwidth-bound)."""
    step_overhead_s: float = 0.002
    """Per-step CPU time (scheduling, kernel launches, sampling) a serving engine adds."""
    memory_util: float = 0.9
    """Share of the GPU's memory the engine may use (weights + KV)."""
    source: str = ""

    def __post_init__(self) -> None:
        if self.dtype == "fp8" and not self.gpu.fp8_tflops:
            raise ProfileError(f"{self.gpu.name} has no FP8 tensor cores; use bfloat16")
        if self.kv_capacity_tokens() <= 0:
            raise ProfileError(f"{self.model.name} in {self.dtype} ({self._weight_bytes() / 1e9:.0f} GB) does not fit "
                               f"one {self.gpu.name} ({self.gpu.memory_gb:g} GB at {self.memory_util:.0%})")
        self.source = self.source or (f"analytic: {self.gpu.source}; {self.compute_eff:.0%} of peak FLOPS, "
                                      f"{self.memory_eff:.0%} of HBM bandwidth, "
                                      f"{self.step_overhead_s * 1e3:g} ms per step")

    def _weight_bytes(self) -> float:
        return self.model.params * DTYPE_BYTES[self.dtype]

    def step_s(self, prefill_tokens: int, decode_seqs: int, prefill_pairs: int, decode_context: int) -> float:
        m = self.model
        flops = (2 * m.params * (prefill_tokens + decode_seqs)
                 + 4 * m.num_layers * m.hidden_size * (prefill_pairs + decode_context))
        peak = (self.gpu.fp8_tflops if self.dtype == "fp8" else self.gpu.bf16_tflops) * 1e12
        moved = self._weight_bytes() + (prefill_tokens + decode_context) * m.kv_bytes_per_token(self.dtype)
        return max(flops / (peak * self.compute_eff), moved / (self.gpu.hbm_tbps * 1e12 * self.memory_eff)) \
            + self.step_overhead_s

    def kv_capacity_tokens(self) -> int:
        free = self.gpu.memory_gb * 1e9 * self.memory_util - self._weight_bytes()
        return int(free // self.model.kv_bytes_per_token(self.dtype))

    def describe(self) -> dict:
        return {"kind": "analytic", "gpu": asdict(self.gpu), "model": asdict(self.model), "dtype": self.dtype,
                "compute_eff": self.compute_eff, "memory_eff": self.memory_eff,
                "step_overhead_s": self.step_overhead_s, "memory_util": self.memory_util,
                "kv_capacity_tokens": self.kv_capacity_tokens(), "source": self.source}


def _measured_from(raw: dict, where: str) -> MeasuredProfile:
    try:
        model = ModelSpec(**raw["model"])
        prof = MeasuredProfile(model, raw["dtype"], float(raw["c0"]), float(raw["c_prefill"]),
                               float(raw["c_decode"]), float(raw["c_attend"]), float(raw["c_context"]),
                               raw.get("source", ""),
                               raw.get("machine", {}), raw.get("fit", {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{where}: not a measured profile ({type(exc).__name__}: {exc})") from None
    if prof.dtype not in DTYPE_BYTES:
        raise ProfileError(f"{where}: dtype {prof.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    bad = [k for k in ("c0", "c_prefill", "c_decode", "c_attend", "c_context")
           if not math.isfinite(getattr(prof, k)) or getattr(prof, k) < 0]
    if bad:
        raise ProfileError(f"{where}: {bad[0]} must be a finite number >= 0")
    return prof


def load_profile(spec: str) -> Profile:
    """A profile from a file written by ``kvrelay profile``, or a built-in
    ``GPU:MODEL[:DTYPE]`` (e.g. ``h100:llama-3.1-8b:fp8``; dtype bfloat16 by default)."""
    path = Path(spec)
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileError(f"{path}: not a readable JSON profile ({exc})") from None
        if not isinstance(raw, dict) or raw.get("kind") != "measured":
            raise ProfileError(f"{path}: expected a profile written by `kvrelay profile` (kind: measured)")
        return _measured_from(raw, str(path))
    parts = spec.lower().split(":")
    if len(parts) not in (2, 3) or parts[0] not in GPUS or parts[1] not in MODELS:
        raise ProfileError(f"profile {spec!r}: not a file, nor GPU:MODEL[:DTYPE] with GPU one of "
                           f"{', '.join(GPUS)} and MODEL one of {', '.join(MODELS)}")
    dtype = parts[2] if len(parts) == 3 else "bfloat16"
    if dtype not in ("bfloat16", "fp8"):
        raise ProfileError(f"profile {spec!r}: dtype must be bfloat16 or fp8")
    return AnalyticProfile(GPUS[parts[0]], MODELS[parts[1]], dtype)
