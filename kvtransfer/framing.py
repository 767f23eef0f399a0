"""Length-prefixed protobuf frames on asyncio streams: a 4-byte
little-endian length, then a serialized ``KVFrame``."""

from __future__ import annotations

import asyncio
import struct

from kvrelay.v1 import kv_wire_pb2 as pb

MAX_FRAME = 1 << 20
"""Largest header frame accepted (payloads are not frames)."""


async def read_frame(reader: asyncio.StreamReader, timeout: float) -> pb.KVFrame:
    head = await asyncio.wait_for(reader.readexactly(4), timeout)
    (n,) = struct.unpack("<I", head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    body = await asyncio.wait_for(reader.readexactly(n), timeout)
    frame = pb.KVFrame()
    frame.ParseFromString(body)
    return frame


def encode_frame(frame: pb.KVFrame) -> bytes:
    body = frame.SerializeToString()
    return struct.pack("<I", len(body)) + body
