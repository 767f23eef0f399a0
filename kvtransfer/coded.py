"""A blocks frame's payload under a KV codec (kvtransfer/codecs.py): what a
sender writes in place of the cache's bytes, and how a receiver lands it.

The payload is, for each layer of the frame, K then V of the frame's blocks
(in the order of the reservation), each as its scales, then its encoded
values. Only caches whose planes are K and V of ``[block, token, head,
channel]`` (this engine's ``kvrelay-kv-v1``) take a codec: vLLM's page of
both is laid out for its kernels, so a receiver with one refuses any codec
in the handshake."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvrelay.engine.kv_cache import KVLayout, torch_dtype
from kvrelay.kvtransfer.base import KVCodec
from kvrelay.kvtransfer.codecs import decode, encode, encoded_bytes, from_bytes, to_bytes

CODEC_FORMAT = "kvrelay-kv-v1"
"""The cache format whose planes the codecs read and write."""


def plane_shape(layout: KVLayout, count: int) -> tuple[int, int, int, int]:
    """One plane (K or V of one layer) of ``count`` blocks: [blocks, tokens, heads, head_dim]."""
    return count, layout.block_size, layout.num_kv_heads, layout.head_dim


def codecs_for(layout: KVLayout) -> frozenset[KVCodec]:
    """The codecs a cache of ``layout`` can take: all for this engine's planes, none but none otherwise."""
    if layout.kinds == 2 and layout.format == CODEC_FORMAT:
        return frozenset(KVCodec)
    return frozenset({KVCodec.NONE})


def coded_bytes(codec: KVCodec, layout: KVLayout, count: int, num_layers: int) -> int:
    """Payload bytes of a frame of ``count`` blocks and ``num_layers`` layers under ``codec``."""
    return num_layers * layout.kinds * encoded_bytes(codec, plane_shape(layout, count), layout.element_size)


def encode_planes(codec: KVCodec, layout: KVLayout, planes: list[list[memoryview]], count: int
                  ) -> list[memoryview]:
    """The payload of a frame whose planes (each a list of views of its runs of blocks, in order)
    are ``planes``: per plane, its scales' bytes then its values'."""
    dtype, shape = torch_dtype(layout.dtype), plane_shape(layout, count)
    out: list[memoryview] = []
    for views in planes:
        parts = [torch.frombuffer(v, dtype=torch.uint8) for v in views if len(v)]
        raw = parts[0] if len(parts) == 1 else torch.cat(parts)
        out += to_bytes(encode(codec, raw.view(dtype).view(shape)))
    return out


def decode_planes(codec: KVCodec, layout: KVLayout, payload: torch.Tensor, count: int, planes: int
                  ) -> Iterator[torch.Tensor]:
    """The ``planes`` planes of a received payload (uint8, exactly :func:`coded_bytes`), decoded into the
    cache's dtype, in order; ValueError when the payload does not fit."""
    shape, dtype = plane_shape(layout, count), torch_dtype(layout.dtype)
    size = encoded_bytes(codec, shape, 1)
    if payload.numel() != planes * size:
        raise ValueError(f"a {codec} payload of {payload.numel()} bytes for {planes} planes of {count} blocks")
    for i in range(planes):
        yield decode(from_bytes(codec, shape, payload[i * size:(i + 1) * size]), dtype)
