"""Linear layers with optional pre-packed weights.

On CPU in fp32, oneDNN's packed weight format (what torch's own compiler
uses when it freezes a model) avoids re-laying out the weight on every call.
On this project's 2-core AVX2 machines it is 2-2.5x faster than ``F.linear``
at 8-32 rows (batched decode) and ~1.5x on the vocabulary projection; see
benchmarks/RESULTS.md. Elsewhere (CUDA, bf16) this is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACK_HINT = 8
"""Batch-size hint for the packed layout; measured good from 1 to 300 rows."""


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    """``y = x @ W^T + b`` for 2-D ``x``."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(self.weight, _PACK_HINT)
                       if pack and can_pack(self.weight) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
