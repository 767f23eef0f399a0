"""Typed configuration of the engine: the model (from a checkpoint's
config.json), the KV cache and the scheduler. Parsed once, validated when
built; everything below receives these objects, never raw dicts.

The KV cache and the scheduler are also sections of the cluster config file
(``cache:``, ``scheduler:``; runtime/config.py), so the building blocks every
section of that file shares live here, in the lowest layer that has one:
:data:`SECTION_CONFIG` (pydantic: unknown keys and NaN/inf refused),
:func:`field_docs` (a section's field docstrings, read from its source), :class:`ConfigSection` (a raw mapping's keys
checked before its fields), :class:`FieldError` and :func:`choice`."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import json
import reprlib
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic import dataclasses as pydantic_dataclasses
from pydantic_core import ArgsKwargs

from kvrelay.engine.errors import CheckpointError

#: Architectures (config.json ``architectures[0]``) that the Llama-family
#: implementation covers, with the quirks each one turns on.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

DType = Literal["float32", "bfloat16", "float16"]
RopeKind = Literal["default", "linear", "llama3"]


@dataclass(slots=True, frozen=True)
class RopeConfig:
    """Rotary position embedding parameters."""

    theta: float
    """Base frequency (``rope_theta``)."""
    kind: RopeKind = "default"
    """Scaling scheme; ``llama3`` is Llama 3.1's frequency-dependent scaling."""
    factor: float = 1.0
    """Scaling factor for ``linear`` and ``llama3``."""
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, raw: dict) -> RopeConfig:
        """Reads both the legacy (``rope_theta`` + ``rope_scaling``) and the
        transformers 5 (``rope_parameters``) spellings."""
        params = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or {}
        merged = {**scaling, **params}
        theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
        kind = merged.get("rope_type", merged.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise CheckpointError(f"config.json: unsupported rope scaling type {kind!r} "
                                  "(supported: default, linear, llama3)")
        return cls(
            theta=theta,
            kind=cast(RopeKind, kind),  # one of them: checked above
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))),
        )


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family model, read from config.json."""

    architecture: str
    """Family flavour: ``llama``, ``mistral`` or ``qwen2``."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    """Bias on the q/k/v projections (Qwen2, some Llama variants)."""
    sliding_window: int | None
    """Attention window (Mistral v0.1); ``None`` means full attention."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str = "model"

    def __post_init__(self) -> None:
        for fname in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, fname) <= 0:
                raise CheckpointError(f"config.json: {fname} must be positive, got {getattr(self, fname)}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"config.json: num_attention_heads ({self.num_heads}) is not a multiple "
                                  f"of num_key_value_heads ({self.num_kv_heads})")

    @classmethod
    def from_dict(cls, raw: dict, name: str = "model") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch_name = archs[0] if archs else None
        if arch_name not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"config.json: unknown architecture {arch_name!r}; "
                                  f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        arch = SUPPORTED_ARCHITECTURES[arch_name]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = raw.get("sliding_window")
            if arch == "qwen2" and not raw.get("use_sliding_window", False):
                window = None
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rope=RopeConfig.from_hf(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
                sliding_window=int(window) if window else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json: bad value: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path, name: str | None = None) -> ModelConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: config.json is not valid JSON ({exc})") from None
        return cls.from_dict(raw, name=name or Path(path).parent.name)


SECTION_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
"""pydantic's settings of every config section: an unknown key, NaN or an infinity is refused.
(Not ``use_attribute_docstrings``: that reads every section's source as the module is imported,
~0.13 s of every process's start; what wants the docstrings asks :func:`field_docs`.)"""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings of ``cls``'s fields (a string literal right after a field's
    annotated assignment in the class body), by field name, read from its source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef), cls
    out: dict[str, str] = {}
    for field_stmt, doc in itertools.pairwise(body.body):
        if (isinstance(field_stmt, ast.AnnAssign) and isinstance(field_stmt.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            out[field_stmt.target.id] = inspect.cleandoc(doc.value.value)
    return out

MAX_TOKENS = 10_000_000
"""Bound of token counts in the config: well past any model's context window."""


class _Repr(reprlib.Repr):
    """reprlib cut short: deep, long or recursive values and huge integers stay one short line."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 60, 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() <= 64:
            return repr(x)
        return f"{'a negative' if x < 0 else 'an'} integer of about {int(x.bit_length() * 0.30103) + 1} digits"


_REPR = _Repr()


def show(value: Any) -> str:
    """``repr(value)`` for an error message, bounded whatever the value is."""
    return _REPR.repr(value)


class FieldError(ValueError):
    """A section's own field is invalid. Raised while a section is built with
    the field's name relative to the section; the loader (runtime/config.py)
    prefixes the section's path (``router`` + ``port`` -> ``router.port: ...``)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def choice(values: Iterable[str], listing: str) -> BeforeValidator:
    """The check of a field that YAML spells as one of ``values`` (an enum's or a
    Literal's): ``must be <listing>, got 'x'`` otherwise, and never a non-string."""
    allowed = frozenset(str(v) for v in values)

    def check(value: Any) -> Any:
        if value is None:
            raise ValueError("must not be null")
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {show(value)}")
        if value not in allowed:
            raise ValueError(f"must be {listing}, got {value!r}")
        return value

    return BeforeValidator(check)


def _string_list(value: Any) -> Any:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a list of strings")
    return value


StringList = Annotated[list[StrictStr], BeforeValidator(_string_list)]
"""A config field that is a list of strings (null or anything else refused)."""


@pydantic_dataclasses.dataclass(slots=True, config=SECTION_CONFIG)
class ConfigSection:
    """Base of every section of the cluster config: given a mapping (YAML's), a
    section first checks its keys, naming the fields it has, or where a key of
    :attr:`MOVED` went; null stands for an empty mapping (every field's default)."""

    MOVED: ClassVar[dict[str, str]] = {}
    """Keys this section no longer has, and what replaced them (the hint its error gives)."""

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, raw: Any) -> Any:
        if raw is None:
            return {}
        if isinstance(raw, (cls, ArgsKwargs)):  # an instance, or built in code (its fields are checked)
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"expected a mapping, got {type(raw).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k if isinstance(k, str) else show(k) for k in raw if k not in names)
        for key in unknown:
            if key in cls.MOVED:
                raise FieldError(key, cls.MOVED[key])
        if unknown:
            listed = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
            raise ValueError(f"unknown field(s) {listed}; expected {', '.join(names)}")
        return raw


@pydantic_dataclasses.dataclass(slots=True, config=SECTION_CONFIG)
class CacheConfig(ConfigSection):
    """The paged KV cache of one worker."""

    block_size: StrictInt = Field(default=16, ge=1, le=4_096)
    """Tokens per KV block: the unit of allocation, prefix caching and transfer."""
    num_blocks: StrictInt | None = Field(default=None, ge=2, le=1 << 24)
    """Blocks to preallocate; when ``None`` they are derived from ``memory_gib``."""
    memory_gib: StrictFloat = Field(default=1.0, gt=0, le=4_096)
    """KV memory budget used when ``num_blocks`` is not given (4 TiB at most)."""
    enable_prefix_caching: StrictBool = True
    """Reuse blocks of earlier requests whose chained hashes match."""

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"cache.block_size must be a positive power of two, got {self.block_size}")


@pydantic_dataclasses.dataclass(slots=True, config=SECTION_CONFIG)
class SchedulerConfig(ConfigSection):
    """Batching limits of one engine step."""

    max_num_batched_tokens: StrictInt = Field(default=2048, gt=0, le=MAX_TOKENS)
    """Token budget per step (decode tokens + prefill chunk tokens)."""
    max_num_seqs: StrictInt = Field(default=64, gt=0, le=65_536)
    """Most sequences running at once."""
    max_model_len: StrictInt | None = Field(default=None, gt=0, le=MAX_TOKENS)
    """Context window; defaults to the model's ``max_position_embeddings``."""


def effective_max_model_len(model_cfg: ModelConfig, scheduler_cfg: SchedulerConfig) -> int:
    """The context window a worker and the router enforce: ``scheduler.max_model_len``
    when set, else the model's ``max_position_embeddings``, and never more than that."""
    return min(scheduler_cfg.max_model_len or model_cfg.max_position_embeddings,
               model_cfg.max_position_embeddings)


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine instance needs."""

    model_path: Path
    """Hugging Face style checkpoint folder."""
    dtype: DType = "float32"
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None
    """torch intra-op threads on CPU; ``None`` keeps torch's default."""
    kv_shm_path: str | None = None
    """Put the KV cache in this shared-memory file (local KV transport)."""

    def __post_init__(self) -> None:
        self.model_path = Path(self.model_path)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"engine.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ValueError("engine.dtype float16 is only supported on CUDA; use bfloat16 or float32 on CPU")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"engine.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
