"""Decode worker: reserves KV blocks, receives KV, decodes in a continuous batch.

Lifecycle of one disaggregated request (``Decode``): reserve blocks for the
prompt (its own prefix cache may already hold the leading blocks) -> send
the reservation to the router as the first event -> wait for the KV (at
most the lease) -> join the running batch with the prefill's first token ->
stream tokens. A colocated request skips the reservation and computes its
prompt here. Cancellation, a failed transfer or an expired lease frees
every block of the request.

Usage (runtime/usage_meter.py), per tenant and the link the KV came over:
every token streamed, the request once it finished, the KV bytes of a
completed transfer, the prompt's computed and cached tokens when computed
here (colocated), and each engine step's time by the tokens it computed.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError, OutOfBlocksError
from kvtransfer.base import KVReceiver
from kvtransfer.errors import KVTransferError, TransferTimeout
from kvtransfer.handles import wait_async
from runtime.convert import output_to_proto, work_params
from runtime.usage_meter import UsageKey, UsageMeter
from runtime.worker import WorkerIdentity, worker_load

log = logging.getLogger(__name__)


class DecodeService(wgrpc.DecodeWorkerServicer):
    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, receiver: KVReceiver,
                 default_lease_s: float = 30.0) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.ident = ident
        self.receiver = receiver
        self.default_lease_s = default_lease_s
        self.usage = UsageMeter()
        """Per tenant and link: requests, tokens, KV bytes received, engine time (decode_worker_s)."""
        self.engine.step_hook = self.usage.on_step

    def load(self) -> wpb.WorkerLoad:
        return worker_load(self.ident, self.engine, kv_in=self.receiver.bytes_received, usage=self.usage)

    async def Stats(self, request, context) -> wpb.WorkerLoad:
        return self.load()

    async def Decode(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext):
        wr = request.request
        rid = wr.request_id
        try:
            params = work_params(wr)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        prompt = list(wr.prompt_token_ids)
        key = UsageKey(wr.tenant, "" if request.colocated else request.link)
        if request.colocated:
            try:
                first = True
                async for out in self.aengine.generate(rid, prompt, params, wr.salt, account=key,
                                                       priority=int(wr.batch)):
                    self.usage.count_output(key, out, computed_prompt=first)
                    first = False
                    yield wpb.DecodeEvent(output=output_to_proto(out))
            except InvalidRequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        async for event in self._disaggregated(rid, prompt, params, wr.salt, request.lease_s, context, key):
            yield event

    async def _disaggregated(self, rid, prompt, params, salt, lease_s, context, key: UsageKey):
        q = self.aengine.open_stream(rid)
        finished = False
        try:
            try:
                blocks, start = await self.aengine.call(self.engine.reserve, rid, prompt, params, salt, key)
            except InvalidRequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except OutOfBlocksError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker is full: {exc}")
            handle = self.receiver.expect(rid, blocks[start:])
            yield wpb.DecodeEvent(reservation=wpb.KVTarget(
                endpoint=self.receiver.endpoint, transfer_id=rid, start_block=start, block_ids=blocks[start:],
                layout_hash=self.engine.layout.compat_hash(), transport=self.receiver.name))
            try:
                res = await wait_async(handle, lease_s or self.default_lease_s)
            except TransferTimeout:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "KV did not arrive before the lease expired")
            except KVTransferError as exc:
                await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {exc.reason}")
            self.usage.count(key, kv_bytes=res.nbytes)
            try:  # the first token's top_logprobs (an empty entry here) reach the router from the prefill worker
                first = await self.aengine.call(self.engine.commit_prefilled, rid, res.first_token_id,
                                                res.first_logprob if params.logprobs else None)
            except InvalidRequestError as exc:  # from the wire: the router recovers as for a failed transfer
                await context.abort(grpc.StatusCode.ABORTED, f"KV transfer refused: {exc}")
            finished = first.finished
            self.usage.count_output(key, first)
            yield wpb.DecodeEvent(output=output_to_proto(first))
            if finished:
                return
            async for out in self.aengine.outputs(rid, q):
                finished = out.finished
                self.usage.count_output(key, out)
                yield wpb.DecodeEvent(output=output_to_proto(out))
        finally:
            # off the event loop: it waits for a receive into the blocks to end
            await asyncio.shield(asyncio.to_thread(self.receiver.cancel, rid))
            self.aengine.close_stream(rid)
            if not finished:
                await asyncio.shield(self.aengine.call(self.engine.abort_request, rid))
