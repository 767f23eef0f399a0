"""TCP KV transport: a decode worker's receiver writes incoming KV straight
into reserved blocks; a prefill worker's sender streams its blocks, one
(layer, K/V) run per frame, each with a CRC32.

Handshake: the sender's ``KVHello`` carries the protocol version, the
layout compatibility hash and the transfer id; the receiver checks all
three before it accepts a single KV byte.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import dataclass, field

import torch

from engine.kv_cache import KVCache
from engine.layers.attention import gather_blocks
from kvrelay.v1 import kv_wire_pb2 as pb
from kvtransfer.errors import HandshakeRefused, KVTransferError
from kvtransfer.framing import encode_frame, read_frame

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


@dataclass(slots=True)
class TransferResult:
    first_token_id: int
    first_logprob: float
    nbytes: int
    seconds: float


@dataclass(slots=True)
class _Expected:
    block_ids: list[int]
    future: asyncio.Future
    received: dict[tuple[int, int], int] = field(default_factory=dict)
    nbytes: int = 0
    started: float = 0.0


class TcpKVReceiver:
    """Accepts KV for registered reservations (``expect``) into ``cache``."""

    def __init__(self, cache: KVCache, host: str = "127.0.0.1", io_timeout_s: float = 30.0) -> None:
        self.cache = cache
        self.host = host
        self.io_timeout_s = io_timeout_s
        self._expected: dict[str, _Expected] = {}
        self._server: asyncio.base_events.Server | None = None
        self.port = 0
        self.bytes_received = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, self.host, 0, limit=1 << 22)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def expect(self, transfer_id: str, block_ids: list[int]) -> asyncio.Future:
        """Registers a reservation; the future resolves to a TransferResult."""
        fut = asyncio.get_running_loop().create_future()
        self._expected[transfer_id] = _Expected(list(block_ids), fut)
        return fut

    def cancel(self, transfer_id: str) -> None:
        exp = self._expected.pop(transfer_id, None)
        if exp is not None and not exp.future.done():
            exp.future.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tid = "?"
        exp = None
        try:
            hello = (await read_frame(reader, self.io_timeout_s)).hello
            tid = hello.transfer_id
            reason = self._check_hello(hello)
            writer.write(encode_frame(pb.KVFrame(hello_ack=pb.KVHelloAck(accepted=not reason, reason=reason))))
            await writer.drain()
            if reason:
                log.warning("refused KV transfer %s: %s", tid, reason)
                return
            exp = self._expected[tid]
            exp.started = time.perf_counter()
            while True:
                frame = await read_frame(reader, self.io_timeout_s)
                kind = frame.WhichOneof("body")
                if kind == "blocks":
                    await self._receive_blocks(reader, exp, frame.blocks)
                elif kind == "done":
                    self._finish(tid, exp, frame.done)
                    writer.write(encode_frame(pb.KVFrame(done_ack=pb.KVDoneAck(ok=True))))
                    await writer.drain()
                    return
                else:
                    raise ValueError(f"unexpected frame {kind!r}")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as exc:
            self._fail(tid, exp, f"connection lost or timed out ({type(exc).__name__})")
        except (ValueError, KVTransferError) as exc:
            self._fail(tid, exp, str(exc))
            try:
                writer.write(encode_frame(pb.KVFrame(done_ack=pb.KVDoneAck(ok=False, reason=str(exc)))))
                await writer.drain()
            except ConnectionError:
                pass
        finally:
            writer.close()

    def _check_hello(self, hello: pb.KVHello) -> str:
        if hello.protocol_version != PROTOCOL_VERSION:
            return f"protocol version {hello.protocol_version} unsupported (receiver speaks {PROTOCOL_VERSION})"
        if hello.layout_hash != self.cache.layout.compat_hash():
            return "KV layout mismatch (model, dtype, layers, heads, head dim or block size differ)"
        if hello.transfer_id not in self._expected:
            return f"no reservation named {hello.transfer_id!r}"
        return ""

    async def _receive_blocks(self, reader: asyncio.StreamReader, exp: _Expected, hdr: pb.KVBlocks) -> None:
        layout = self.cache.layout
        if hdr.layer >= layout.num_layers or hdr.kind > 1:
            raise ValueError(f"layer {hdr.layer} / kind {hdr.kind} out of range")
        if hdr.count == 0 or hdr.first + hdr.count > len(exp.block_ids):
            raise ValueError(f"blocks [{hdr.first}, {hdr.first + hdr.count}) outside the reservation")
        if hdr.payload_bytes != hdr.count * layout.block_bytes:
            raise ValueError(f"payload of {hdr.payload_bytes} bytes for {hdr.count} blocks")
        data = await asyncio.wait_for(reader.readexactly(hdr.payload_bytes), self.io_timeout_s)
        if zlib.crc32(data) != hdr.crc32:
            raise KVTransferError("", f"checksum mismatch in layer {hdr.layer} kind {hdr.kind}",
                                  exp.block_ids[hdr.first:hdr.first + hdr.count])
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.cache.kv.dtype)
        dest = torch.tensor(exp.block_ids[hdr.first:hdr.first + hdr.count], dtype=torch.long)
        target = self.cache.kv[hdr.layer, hdr.kind]
        target.index_copy_(0, dest, src.view(hdr.count, *target.shape[1:]).to(target.device))
        key = (hdr.layer, hdr.kind)
        exp.received[key] = exp.received.get(key, 0) + hdr.count
        exp.nbytes += hdr.payload_bytes
        self.bytes_received += hdr.payload_bytes

    def _finish(self, tid: str, exp: _Expected, done: pb.KVDone) -> None:
        want = len(exp.block_ids)
        layers = self.cache.layout.num_layers
        missing = [(l, k) for l in range(layers) for k in (0, 1) if exp.received.get((l, k), 0) != want]
        if missing:
            raise KVTransferError(tid, f"transfer incomplete: {len(missing)} (layer, K/V) runs missing")
        self._expected.pop(tid, None)
        if not exp.future.done():
            exp.future.set_result(TransferResult(done.first_token_id, done.first_logprob, exp.nbytes,
                                                 time.perf_counter() - exp.started))

    def _fail(self, tid: str, exp: _Expected | None, reason: str) -> None:
        if exp is None:
            return
        self._expected.pop(tid, None)
        if not exp.future.done():
            exp.future.set_exception(KVTransferError(tid, reason))


async def send_kv(endpoint: str, transfer_id: str, layout_hash: str, cache: KVCache, src_blocks: list[int],
                  first_token_id: int, first_logprob: float, timeout_s: float = 30.0) -> int:
    """Pushes every layer's K and V of ``src_blocks`` to the receiver at
    ``endpoint``; returns the KV bytes sent once the receiver acknowledged."""
    host, _, port = endpoint.rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise KVTransferError(transfer_id, f"cannot connect to {endpoint}: {exc}") from None
    try:
        writer.write(encode_frame(pb.KVFrame(hello=pb.KVHello(
            protocol_version=PROTOCOL_VERSION, layout_hash=layout_hash, transfer_id=transfer_id))))
        await writer.drain()
        ack = (await read_frame(reader, timeout_s)).hello_ack
        if not ack.accepted:
            raise HandshakeRefused(transfer_id, ack.reason)
        idx = torch.tensor(src_blocks, dtype=torch.long, device=cache.kv.device)
        total = 0
        for layer in range(cache.layout.num_layers):
            for kind in (0, 1):
                data = gather_blocks(cache.kv[layer, kind], idx).cpu().contiguous()
                payload = memoryview(data.view(torch.uint8).numpy())
                hdr = pb.KVBlocks(layer=layer, kind=kind, first=0, count=len(src_blocks),
                                  payload_bytes=payload.nbytes, crc32=zlib.crc32(payload))
                writer.write(encode_frame(pb.KVFrame(blocks=hdr)))
                writer.write(payload)
                await asyncio.wait_for(writer.drain(), timeout_s)
                total += payload.nbytes
        writer.write(encode_frame(pb.KVFrame(done=pb.KVDone(first_token_id=first_token_id,
                                                             first_logprob=first_logprob))))
        await writer.drain()
        ack = (await read_frame(reader, timeout_s)).done_ack
        if not ack.ok:
            raise KVTransferError(transfer_id, f"receiver rejected the transfer: {ack.reason}")
        return total
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as exc:
        raise KVTransferError(transfer_id, f"connection to {endpoint} failed ({type(exc).__name__})") from None
    finally:
        writer.close()
