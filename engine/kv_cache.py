"""The paged KV cache: one preallocated tensor holding K and V of every layer
in blocks of ``block_size`` tokens, and the layout descriptor that says how
its bytes are arranged.

Shape: ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``,
contiguous. So "K (or V) of layer L, block b" is one contiguous run of
``block_bytes`` bytes at a computable offset, and "layer L of blocks [b...]"
is addressable without copying: exactly what a transport needs to register
the memory once and move blocks by offset.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from kvrelay.engine.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What two workers must agree on before KV bytes can move between them."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kinds: int = 2
    """Planes per layer and block: 2 when K and V of a block lie apart (this
    engine's cache), 1 when one page holds both (vLLM's CPU cache)."""
    format: str = "kvrelay-kv-v1"
    """How the bytes of a block are arranged; equal formats (and fields) mean
    byte-compatible KV. vLLM's names its platform, layout and kernel ISA."""

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype: str, block_size: int) -> KVLayout:
        return cls(cfg.name, dtype, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size)

    @property
    def element_size(self) -> int:
        return torch_dtype(self.dtype).itemsize  # on the transfer path: no tensor per call

    @property
    def block_bytes(self) -> int:
        """Bytes of one plane of one layer of one block: K (or V) when
        ``kinds`` is 2, the whole page when it is 1."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size * (2 // self.kinds)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block over all layers, K and V."""
        return self.kinds * self.num_layers * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    def compat_hash(self) -> str:
        """Hex digest identifying the layout; equal hashes mean byte-compatible KV."""
        text = (f"{self.model}|{self.dtype}|{self.num_layers}|{self.num_kv_heads}|"
                f"{self.head_dim}|{self.block_size}|{self.format}")
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(slots=True, frozen=True)
class MemoryRegion:
    """A registrable range of KV memory."""

    address: int
    nbytes: int
    device: str


class KVCache:
    """The KV tensor of one worker and the arithmetic to address it."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str = "cpu",
                 shm_path: str | None = None, create: bool = True) -> None:
        """``shm_path`` (host memory only) backs the tensor with a shared file,
        e.g. under /dev/shm, so a transport on the same host can map it."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.shm_path = shm_path
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        if shm_path is None:
            self.kv = torch.zeros(shape, dtype=torch_dtype(layout.dtype), device=device)
        else:
            if device != "cpu":
                raise ValueError("a shared-memory KV cache must be in host memory")
            if create and os.path.exists(shm_path):
                os.unlink(shm_path)  # a stale file of a dead process; start clean
            numel = 1
            for d in shape:
                numel *= d
            self.kv = torch.from_file(shm_path, shared=True, size=numel,
                                      dtype=torch_dtype(layout.dtype)).view(shape)

    @classmethod
    def wrap(cls, layout: KVLayout, kv: torch.Tensor) -> KVCache:
        """A cache over memory another engine owns: ``kv`` shaped
        ``[num_layers, layout.kinds, num_blocks, ...]``, each layer's block one
        contiguous run of ``layout.kinds * layout.block_bytes`` bytes."""
        if kv.shape[0] != layout.num_layers or kv.shape[1] != layout.kinds or not kv.is_contiguous():
            raise ValueError(f"a wrapped KV tensor must be contiguous [{layout.num_layers}, {layout.kinds}, blocks, "
                             f"...], got {tuple(kv.shape)}")
        cache = cls.__new__(cls)
        cache.layout, cache.num_blocks, cache.device, cache.shm_path = layout, kv.shape[2], str(kv.device), None
        cache.kv = kv
        return cache

    @classmethod
    def attach(cls, layout: KVLayout, num_blocks: int, shm_path: str) -> KVCache:
        """Maps another process's shared-memory KV cache (same layout)."""
        if not os.path.exists(shm_path):
            raise FileNotFoundError(f"{shm_path}: no such shared KV cache")
        expected = num_blocks * layout.bytes_per_block
        if os.path.getsize(shm_path) != expected:
            raise ValueError(f"{shm_path}: {os.path.getsize(shm_path)} bytes, layout implies {expected}")
        return cls(layout, num_blocks, "cpu", shm_path, create=False)

    def unlink(self) -> None:
        """Removes the shared file (mappings stay valid until closed)."""
        if self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)

    @staticmethod
    def blocks_for_budget(layout: KVLayout, memory_bytes: int) -> int:
        return max(2, memory_bytes // layout.bytes_per_block)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer, each ``[num_blocks, block_size, H, D]``."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def regions(self) -> list[MemoryRegion]:
        """The memory a transport registers (one region: the whole tensor)."""
        return [MemoryRegion(self.kv.data_ptr(), self.kv.numel() * self.kv.element_size(),
                             str(self.kv.device))]

    def block_offset(self, layer: int, kind: int, block: int) -> int:
        """Byte offset of K (``kind=0``) or V (``kind=1``) of ``layer``, ``block``."""
        return ((layer * self.layout.kinds + kind) * self.num_blocks + block) * self.layout.block_bytes
