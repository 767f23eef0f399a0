"""KV codecs (issue 35, first part): a run of blocks of one K or V plane,
``[blocks, tokens, heads, head_dim]`` in the cache's dtype, as fewer bytes,
and back into any dtype. The TCP transport carries them (kvtransfer/coded.py:
a blocks frame's payload under the connection's codec).

- ``int8``: symmetric, one float32 scale per channel of a head over a group
  of :data:`SCALE_BLOCKS` blocks: amax / 127.
- ``fp8``: e4m3 (torch.float8_e4m3fn), one float32 scale per channel of a head
  over a group of :data:`SCALE_BLOCKS` blocks: amax / 448 (e4m3's largest
  finite value).
- ``int4``: symmetric, one float16 scale per group of :data:`INT4_GROUP`
  channels of a (block, token, head), amax / 7; two values a byte.

A scale per channel, not per (block, head), because K has outlier channels:
with one scale per head they set every channel's step, and greedy agreement
over 32 tokens fell from 91% to 59% in the measurement that chose this
(benchmarks/RESULTS.md, "KV codecs' cost in answers"). Sharing it over
:data:`SCALE_BLOCKS` blocks keeps the scales' bytes small (1.94x against bf16).

The scales are dynamic (computed from the data), so they travel with the
bytes; :func:`encoded_bytes` counts both. Error bounds, per element, for a
finite input (tests/unit/test_kv_codecs.py checks them on a real model's KV):
int8 and int4 at most half a step of their scale; fp8 at most 2^-4 of the
value (three mantissa bits, rounded) plus half its smallest subnormal step
times the scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kvtransfer.base import INT4_GROUP, SCALE_BLOCKS, KVCodec

FP8_MAX = 448.0
"""e4m3's largest finite value."""
FP8_SUBNORMAL_STEP = 2.0 ** -9
"""e4m3's smallest subnormal."""


@dataclass(slots=True)
class EncodedRun:
    """A plane's run of blocks, encoded: ``data`` (uint8) and its ``scales``."""

    codec: KVCodec
    shape: tuple[int, ...]
    """The run's shape, [blocks, tokens, heads, head_dim]."""
    data: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def _scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """amax / top, with 1 where a group is all zeros (any scale encodes zeros exactly)."""
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def encode(codec: KVCodec, x: torch.Tensor) -> EncodedRun:
    """``x`` ([blocks, tokens, heads, head_dim], any float dtype) under ``codec``."""
    if x.dim() != 4:
        raise ValueError(f"a KV run is [blocks, tokens, heads, head_dim], got shape {tuple(x.shape)}")
    shape = tuple(x.shape)
    if codec is KVCodec.NONE:
        return EncodedRun(codec, shape, x.contiguous().view(-1).view(torch.uint8), torch.empty(0))
    xf = x.float()
    if codec is KVCodec.INT4:
        return _encode_int4(xf, shape)
    groups = _grouped(xf)  # [groups, SCALE_BLOCKS * tokens, heads, head_dim]
    amax = groups.abs().amax(dim=1)  # [groups, heads, head_dim]
    if codec is KVCodec.INT8:
        scale = _scale(amax, 127.0)
        q = torch.round(groups / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    elif codec is KVCodec.FP8:
        scale = _scale(amax, FP8_MAX)
        q = (groups / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"unknown KV codec {codec!r}")
    data = q.view(-1, *shape[1:])[:shape[0]].contiguous()
    return EncodedRun(codec, shape, data.view(torch.uint8).view(-1), scale)


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([blocks, t, h, d]) as [groups, SCALE_BLOCKS * t, h, d], the last group padded with zeros."""
    b, t, h, d = x.shape
    pad = -b % SCALE_BLOCKS
    if pad:
        x = torch.cat((x, x.new_zeros(pad, t, h, d)))
    return x.view(-1, SCALE_BLOCKS * t, h, d)


def _encode_int4(xf: torch.Tensor, shape: tuple[int, ...]) -> EncodedRun:
    b, t, h, d = shape
    if d % INT4_GROUP:
        raise ValueError(f"int4 needs head_dim a multiple of {INT4_GROUP}, got {d}")
    g = xf.view(b, t, h, d // INT4_GROUP, INT4_GROUP)
    scale = _scale(g.abs().amax(dim=-1), 7.0).to(torch.float16)  # [b, t, h, groups]
    q = torch.round(g / scale.float()[..., None]).clamp_(-7, 7).to(torch.int16) + 8  # 1..15
    q = q.view(-1, 2)
    packed = (q[:, 0] | (q[:, 1] << 4)).to(torch.uint8)
    return EncodedRun(KVCodec.INT4, shape, packed, scale)


def decode(enc: EncodedRun, dtype: torch.dtype) -> torch.Tensor:
    """The run back, in ``dtype`` (the receiver's cache dtype)."""
    b, t, h, d = enc.shape
    if enc.codec is KVCodec.NONE:
        raise ValueError("a run under codec none is the cache's own bytes: copy them, do not decode")
    if enc.codec is KVCodec.INT4:
        lo = (enc.data & 0x0F).to(torch.int16) - 8
        hi = (enc.data >> 4).to(torch.int16) - 8
        q = torch.stack((lo, hi), dim=1).view(b, t, h, d // INT4_GROUP, INT4_GROUP)
        return (q.float() * enc.scales.float()[..., None]).view(b, t, h, d).to(dtype)
    if enc.codec is KVCodec.INT8:
        q = enc.data.view(torch.int8).view(b, t, h, d).float()
    elif enc.codec is KVCodec.FP8:
        q = enc.data.view(torch.float8_e4m3fn).view(b, t, h, d).float()
    else:
        raise ValueError(f"unknown KV codec {enc.codec!r}")
    return (_grouped(q) * enc.scales[:, None]).view(-1, t, h, d)[:b].to(dtype)


def encoded_bytes(codec: KVCodec, shape: tuple[int, ...], element_bytes: int) -> int:
    """Bytes a run of ``shape`` takes under ``codec`` (data and scales) whose cache elements take ``element_bytes``."""
    b, t, h, d = shape
    n = b * t * h * d
    if codec is KVCodec.NONE:
        return n * element_bytes
    if codec is KVCodec.INT4:
        return n // 2 + b * t * h * (d // INT4_GROUP) * 2
    return n + -(-b // SCALE_BLOCKS) * h * d * 4


def scales_of(codec: KVCodec, shape: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of the scales of a run of ``shape`` under ``codec`` (a lossy one)."""
    b, t, h, d = shape
    if codec is KVCodec.INT4:
        return (b, t, h, d // INT4_GROUP), torch.float16
    if codec in (KVCodec.INT8, KVCodec.FP8):
        return (-(-b // SCALE_BLOCKS), h, d), torch.float32
    raise ValueError(f"codec {codec} has no scales")


def parts(enc: EncodedRun) -> tuple[torch.Tensor, torch.Tensor]:
    """``enc`` as it travels, on its device: its scales' bytes, then its values' (flat uint8)."""
    return enc.scales.contiguous().view(-1).view(torch.uint8), enc.data.contiguous().view(-1).view(torch.uint8)


def to_bytes(enc: EncodedRun) -> list[memoryview]:
    """``enc`` (in host memory) as it travels: its scales' bytes, then its values' (views, no copy)."""
    return [memoryview(t.numpy()) for t in parts(enc)]  # type: ignore[arg-type]  # numpy's stubs: __buffer__ on 3.12+


def from_bytes(codec: KVCodec, shape: tuple[int, ...], raw: torch.Tensor) -> EncodedRun:
    """The run of ``shape`` whose bytes (``to_bytes``'s, in one uint8 tensor ``raw``) are exactly ``raw``;
    ValueError when ``raw`` has another size."""
    sshape, sdtype = scales_of(codec, shape)
    nscale = sdtype.itemsize
    for dim in sshape:
        nscale *= dim
    if raw.numel() != encoded_bytes(codec, shape, 1):
        raise ValueError(f"{raw.numel()} bytes for a {codec} run of shape {shape}")
    scales = raw[:nscale].clone().view(sdtype).view(sshape)  # a copy: aligned for its dtype
    return EncodedRun(codec, shape, raw[nscale:], scales)
