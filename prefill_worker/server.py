"""Prefill worker: computes prompts and pushes their KV to decode workers.

Lifecycle of one request: ``Prefill`` runs the prompt through the engine as
a one-token request whose blocks are held when it finishes; the KV of the
blocks the decode worker does not already cache is pushed to the target
with the sampled first token; the blocks are released when the receiver
acknowledged (or the transfer failed, or the caller cancelled).
"""

from __future__ import annotations

import logging
import time

import grpc

from cluster.wire import work_params
from cluster.worker_runtime import WorkerIdentity, worker_load
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.errors import KVTransferError
from kvtransfer.tcp import send_kv

log = logging.getLogger(__name__)


class PrefillService(wgrpc.PrefillWorkerServicer):
    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, transfer_timeout_s: float = 30.0) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.ident = ident
        self.transfer_timeout_s = transfer_timeout_s
        self.kv_bytes_sent = 0

    def load(self) -> wpb.WorkerLoad:
        return worker_load(self.ident, self.engine, kv_out=self.kv_bytes_sent)

    async def Stats(self, request, context) -> wpb.WorkerLoad:
        return self.load()

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext) -> wpb.PrefillResponse:
        wr, target = request.request, request.target
        rid = wr.request_id
        if target.layout_hash != self.engine.layout.compat_hash():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV layout of the target differs from ours")
        t0 = time.perf_counter()
        try:
            params = work_params(wr, max_tokens=1)
            out = None
            async for out in self.aengine.generate(rid, list(wr.prompt_token_ids), params, wr.salt,
                                                   hold_blocks=True):
                pass
            t1 = time.perf_counter()
            blocks = await self.aengine.call(self.engine.held_blocks, rid)
            src = blocks[target.start_block:target.start_block + len(target.block_ids)]
            if len(src) != len(target.block_ids):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"target expects {len(target.block_ids)} blocks from block "
                                    f"{target.start_block}; the prompt has {len(blocks)}")
            logprob = out.new_logprobs[0] if out.new_logprobs else 0.0
            nbytes = await send_kv(target.endpoint, target.transfer_id, target.layout_hash, self.engine.cache,
                                   src, out.new_token_ids[0], logprob, self.transfer_timeout_s)
            self.kv_bytes_sent += nbytes
            return wpb.PrefillResponse(first_token_id=out.new_token_ids[0], first_logprob=logprob, kv_bytes=nbytes,
                                       prefill_ms=(t1 - t0) * 1e3, transfer_ms=(time.perf_counter() - t1) * 1e3,
                                       cached_tokens=out.num_cached_tokens)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVTransferError as exc:
            log.warning("transfer for %s failed: %s", rid, exc.reason)
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {exc.reason}")
        finally:
            await self.aengine.call(self.engine.abort_request, rid)
