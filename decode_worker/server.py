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
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.errors import InvalidRequestError, OutOfBlocksError
from kvrelay.kvtransfer.base import KVReceiver
from kvrelay.kvtransfer.errors import KVTransferError, TransferTimeout
from kvrelay.kvtransfer.handles import wait_async
from kvrelay.runtime.convert import output_to_proto, work_params
from kvrelay.runtime.metrics import failure_reason
from kvrelay.runtime.tracing import context_from_metadata, parse_traceparent, within
from kvrelay.runtime.usage_meter import UsageKey, UsageMeter
from kvrelay.runtime.worker import WorkerIdentity, worker_load
from kvrelay.runtime.worker_telemetry import DISABLED, WorkerTelemetry
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Receive:
    """One transfer being received: its span, link, and when the blocks were reserved."""

    span: Span
    link: str
    t0: float = field(default_factory=time.perf_counter)
    open: bool = True


class DecodeService(wgrpc.DecodeWorkerServicer):
    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, receiver: KVReceiver,
                 default_lease_s: float = 30.0, telemetry: WorkerTelemetry = DISABLED) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.ident = ident
        self.receiver = receiver
        self.default_lease_s = default_lease_s
        self.usage = UsageMeter()
        """Per tenant and link: requests, tokens, KV bytes received, engine time (decode_worker_s)."""
        self.engine.step_hook = self.usage.on_step
        self.tel = telemetry
        self.reserve_timeout_s = 10.0
        """How long a reservation may wait for an engine that allocates in a step (vLLM)."""

    def load(self) -> wpb.WorkerLoad:
        return worker_load(self.ident, self.engine, kv_in=self.receiver.bytes_received, usage=self.usage)

    async def Stats(self, request, context) -> wpb.WorkerLoad:
        return self.load()

    async def Decode(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext):
        """The request's tokens (after its KV arrived, or computing the prompt here when
        colocated), in span ``kvrelay.decode``, a child of the router's attempt."""
        wr = request.request
        span = self.tel.tracing.start(
            "kvrelay.decode", context_from_metadata(context.invocation_metadata()), SpanKind.SERVER,
            {**self.tel.attributes(), "kvrelay.request_id": wr.request_id, "kvrelay.tenant": wr.tenant,
             "kvrelay.link": request.link, "kvrelay.colocated": request.colocated,
             "gen_ai.usage.input_tokens": len(wr.prompt_token_ids)})
        try:
            async for event in self._decode(request, context, span):
                yield event
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:300]))
            raise
        finally:
            span.end()

    async def _decode(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext, span: Span):
        wr = request.request
        rid = wr.request_id
        try:
            params = work_params(wr)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        prompt = list(wr.prompt_token_ids)
        key = UsageKey(wr.tenant, "" if request.colocated else request.link)
        if request.colocated:
            gen = self.tel.tracing.start("kvrelay.decode.generate", within(span))
            try:
                first = True
                async for out in self.aengine.generate(rid, prompt, params, wr.salt, account=key,
                                                       priority=int(wr.batch)):
                    self.usage.count_output(key, out, computed_prompt=first)
                    self._generated(gen, out, first)
                    first = False
                    yield wpb.DecodeEvent(output=output_to_proto(out))
            except InvalidRequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            finally:
                gen.end()
            return
        async for event in self._disaggregated(rid, prompt, params, wr.salt, request, context, key, span):
            yield event

    @staticmethod
    def _generated(gen: Span, out, first: bool) -> None:
        """Marks the first token and the finish on the generate span (never raises)."""
        try:
            DecodeService._mark(gen, out, first)
        except Exception:  # telemetry must not fail the request
            log.exception("decode span events failed")

    @staticmethod
    def _mark(gen: Span, out, first: bool) -> None:
        if first:
            gen.add_event("first_token")
        if out.finished:
            gen.add_event("finish", {"gen_ai.response.finish_reasons": [str(out.finish_reason or "")]})

    async def _await_kv(self, handle, lease_s: float, recv: _Receive, context):
        """The transfer's result once the whole KV is here; the call aborts when it fails or the lease ends."""
        try:
            res = await wait_async(handle, lease_s)
        except TransferTimeout:
            self._received(recv, error="lease timeout")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "KV did not arrive before the lease expired")
        except KVTransferError as exc:
            self._received(recv, error=exc.reason)
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {exc.reason}")
        self._received(recv, res)
        return res

    def _received(self, recv: _Receive, res=None, error: str | None = None) -> None:
        """The transfer's span and metrics: bytes and time on success, the reason on failure (never raises)."""
        recv.open = False
        try:
            self._record_transfer(recv, res, error)
        except Exception:  # telemetry must not fail the request
            log.exception("KV transfer telemetry failed")

    def _record_transfer(self, recv: _Receive, res, error: str | None) -> None:
        transport = str(self.receiver.name)
        if self.tel.transfers is not None:
            if res is not None:
                self.tel.transfers.bytes.labels(recv.link, transport).inc(res.nbytes)
                self.tel.transfers.seconds.labels(recv.link, transport).observe(time.perf_counter() - recv.t0)
            else:
                self.tel.transfers.failures.labels(recv.link, failure_reason(error or "").value).inc()
        if res is not None:
            recv.span.set_attribute("kvrelay.kv.bytes", res.nbytes)
            sender = parse_traceparent(res.sender_traceparent)
            if sender is not None:
                recv.span.add_link(sender)
        else:
            recv.span.set_status(Status(StatusCode.ERROR, (error or "")[:300]))
        recv.span.end()

    async def _reserve(self, rid, prompt, params, salt, key: UsageKey) -> tuple[list[int], int]:
        """Blocks for the prompt's KV (and the first not cached here); OutOfBlocksError
        when an engine that allocates in a step (vLLM) has none before the reserve deadline."""
        res = await self.aengine.call(self.engine.reserve, rid, prompt, params, salt, key)
        if not isinstance(res, concurrent.futures.Future):
            return res
        try:
            return await asyncio.wait_for(asyncio.wrap_future(res), self.reserve_timeout_s)
        except TimeoutError:
            raise OutOfBlocksError(f"no blocks for {len(prompt)} prompt tokens within "
                                   f"{self.reserve_timeout_s:g} s") from None

    async def _disaggregated(self, rid, prompt, params, salt, request: wpb.DecodeRequest, context, key: UsageKey,
                             span: Span):
        q = self.aengine.open_stream(rid)
        finished = False
        tr, link = self.tel.tracing, request.link
        gen = recv = None
        try:
            reserve = tr.start("kvrelay.decode.reserve", within(span))
            try:
                blocks, start = await self._reserve(rid, prompt, params, salt, key)
            except InvalidRequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except OutOfBlocksError as exc:
                reserve.set_status(Status(StatusCode.ERROR, "full"))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker is full: {exc}")
            finally:
                reserve.end()
            handle = self.receiver.expect(rid, blocks[start:], sender=request.sender)
            recv = _Receive(tr.start("kvrelay.kv.receive", within(span), attributes={
                "kvrelay.link": link, "kvrelay.transport": str(self.receiver.name),
                "kvrelay.kv.blocks": len(blocks) - start, "kvrelay.kv.cached_blocks": start}), link)
            yield wpb.DecodeEvent(reservation=wpb.KVTarget(
                endpoint=self.receiver.endpoint, transfer_id=rid, start_block=start, block_ids=blocks[start:],
                layout_hash=self.engine.layout.compat_hash(), transport=self.receiver.name))
            res = await self._await_kv(handle, request.lease_s or self.default_lease_s, recv, context)
            self.usage.count(key, kv_bytes=res.nbytes)
            gen = tr.start("kvrelay.decode.generate", within(span))
            try:  # the first token's top_logprobs (an empty entry here) reach the router from the prefill worker
                first = await self.aengine.call(self.engine.commit_prefilled, rid, res.first_token_id,
                                                res.first_logprob if params.logprobs else None)
            except InvalidRequestError as exc:  # from the wire: the router recovers as for a failed transfer
                await context.abort(grpc.StatusCode.ABORTED, f"KV transfer refused: {exc}")
            if first is not None:  # else the engine samples the first token itself (vLLM)
                finished = first.finished
                self.usage.count_output(key, first)
                self._generated(gen, first, True)
                yield wpb.DecodeEvent(output=output_to_proto(first))
                if finished:
                    return
            async for out in self.aengine.outputs(rid, q):
                self.usage.count_output(key, out)
                self._generated(gen, out, first is None)
                first = first or out
                finished = out.finished
                yield wpb.DecodeEvent(output=output_to_proto(out))
        finally:
            if recv is not None and recv.open:  # the router left while the KV was on its way
                self._received(recv, error="cancelled")
            if gen is not None:
                gen.end()
            # off the event loop: it waits for a receive into the blocks to end
            await asyncio.shield(asyncio.to_thread(self.receiver.cancel, rid))
            self.aengine.close_stream(rid)
            if not finished:
                await asyncio.shield(self.aengine.call(self.engine.abort_request, rid))
