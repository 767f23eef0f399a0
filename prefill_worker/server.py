"""Prefill worker: computes prompts and pushes their KV to decode workers.

Lifecycle of one request: ``Prefill`` opens a transfer to the target (the
decode worker's reservation), registers it with the layer streamer, and
runs the prompt through the engine as a one-token request whose blocks are
held when it finishes. While the prefill runs, each layer's finished
blocks stream to the decode worker. The sampled first token closes the
transfer; the blocks are released once the receiver acknowledged, or the
transfer failed, timed out or was cancelled (and no transport thread reads
them any more).

Usage (runtime/usage_meter.py), per tenant and the link to the receiver's
site: the prompt's computed and cached tokens once it is prefilled, and
each engine step's time by the tokens it computed (requests, completion
tokens and KV bytes are the decode worker's to count).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.interface import WorkerEngine
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.kvtransfer.base import KVSender, TransferTarget, Transport
from kvrelay.kvtransfer.errors import KVTransferError
from kvrelay.kvtransfer.handles import wait_async
from kvrelay.kvtransfer.wire import link_socket_buffer
from kvrelay.prefill_worker.streamer import LayerStreamer
from kvrelay.runtime.convert import top_logprobs_proto, work_params
from kvrelay.runtime.tracing import context_from_metadata, traceparent, within
from kvrelay.runtime.usage_meter import UsageKey, UsageMeter, kv_link
from kvrelay.runtime.vllm_bridge import LayerSends
from kvrelay.runtime.vllm_engine import VllmEngine
from kvrelay.runtime.worker import WorkerIdentity, worker_load
from kvrelay.runtime.worker_telemetry import DISABLED, ChunkSpans, WorkerTelemetry
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


def streamer_for(engine: WorkerEngine) -> LayerStreamer | LayerSends:
    """What sends each layer's blocks as the engine computes it: the builtin engine's layer
    hook (prefill_worker/streamer.py) or a vLLM engine's connector (runtime/vllm_bridge.py)."""
    if isinstance(engine, VllmEngine):
        sends = engine.bridge.sends
        if sends is None:
            raise RuntimeError("the vLLM engine has no KV cache registered with kvrelay's connector")
        return sends
    if not isinstance(engine, LLMEngine):
        raise TypeError(f"no layer streamer for a {type(engine).__name__}")
    return LayerStreamer(engine.runner, engine.layout.num_layers)


class PrefillService(wgrpc.PrefillWorkerServicer):
    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, sender: KVSender,
                 transfer_timeout_s: float = 30.0, telemetry: WorkerTelemetry = DISABLED) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.ident = ident
        self.sender = sender
        self.streamer = streamer_for(self.engine)
        self.transfer_timeout_s = transfer_timeout_s
        self.kv_bytes_sent = 0
        self.usage = UsageMeter()
        """Per tenant and link: prompt tokens computed and cached, engine time (prefill_worker_s)."""
        self.tel = telemetry
        self.chunks = ChunkSpans(telemetry.tracing)
        """Spans of each traced prompt's queue time and chunks (made on the engine thread)."""
        self.engine.step_hook = self._on_step
        self._cleanups: set[asyncio.Task] = set()

    def _on_step(self, step) -> None:
        self.usage.on_step(step)
        self.chunks.on_step(step)

    def _spawn_cleanup(self, coro) -> None:
        """Runs ``coro`` in the background (kept referenced; failures logged)."""
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)

        def done(t: asyncio.Task) -> None:
            self._cleanups.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("cleanup failed: %s", t.exception())
        task.add_done_callback(done)

    def load(self) -> wpb.WorkerLoad:
        return worker_load(self.ident, self.engine, kv_out=self.kv_bytes_sent, usage=self.usage)

    async def Stats(self, request, context) -> wpb.WorkerLoad:
        return self.load()

    async def _prefill_unless_failed(self, rid, prompt, params, salt, handle, key: UsageKey, batch: bool = False):
        """Runs the prompt (its engine time counted for ``key``); stops early
        (and raises) if the transfer fails meanwhile, e.g. because the decode worker died."""
        async def run():
            out = None
            async for out in self.aengine.generate(rid, prompt, params, salt, hold_blocks=True, account=key,  # noqa: B007 (the last one is returned)
                                                   priority=int(batch)):
                pass
            return out

        loop = asyncio.get_running_loop()
        failed = loop.create_future()

        def settle() -> None:
            if not failed.done():
                failed.set_result(None)

        handle.add_done_callback(lambda h: loop.call_soon_threadsafe(settle))
        task = asyncio.ensure_future(run())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            raise handle.failure() or KVTransferError(rid, "transfer ended before the prefill")
        return task.result()

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext) -> wpb.PrefillResponse:
        """Computes the prompt and pushes its KV to the target, in span ``kvrelay.prefill``
        (a child of the router's attempt when the call's metadata names it)."""
        wr = request.request
        span = self.tel.tracing.start(
            "kvrelay.prefill", context_from_metadata(context.invocation_metadata()), SpanKind.SERVER,
            {**self.tel.attributes(), "kvrelay.request_id": wr.request_id, "kvrelay.tenant": wr.tenant,
             "gen_ai.usage.input_tokens": len(wr.prompt_token_ids)})
        try:
            return await self._prefill(request, context, span)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:300]))
            raise
        finally:
            span.end()

    async def _checked(self, wr: wpb.WorkRequest, target: wpb.KVTarget, context: grpc.aio.ServicerContext):
        """The request's sampling parameters once it and its target fit this worker (else the call aborts)."""
        if target.layout_hash != self.engine.layout.compat_hash():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV layout of the target differs from ours")
        n_blocks = blocks_for(len(wr.prompt_token_ids), self.engine.layout.block_size)
        if target.start_block + len(target.block_ids) != n_blocks:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"target covers blocks [{target.start_block}, "
                                f"{target.start_block + len(target.block_ids)}); the prompt has {n_blocks}")
        try:
            return work_params(wr, max_tokens=1)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext,
                       span: Span) -> wpb.PrefillResponse:
        wr, target = request.request, request.target
        rid = wr.request_id
        params = await self._checked(wr, target, context)
        key = UsageKey(wr.tenant, kv_link(self.ident.site, target.receiver))
        send = self.tel.tracing.start("kvrelay.kv.send", within(span), attributes={
            "kvrelay.link": key.link, "kvrelay.transport": target.transport or str(self.sender.name),
            "kvrelay.protection": target.protection, "kvrelay.kv.receiver": target.receiver,
            "kvrelay.kv.codec": target.kv_codec or "none",
            "kvrelay.kv.blocks": len(target.block_ids), "kvrelay.kv.cached_blocks": target.start_block})
        handle = self.sender.open(TransferTarget(
            target.endpoint, target.transfer_id, tuple(target.block_ids), target.layout_hash,
            socket_buffer_bytes=link_socket_buffer(target.link_gbps, target.link_rtt_ms),
            protection=target.protection or None, pull=False if target.transport == Transport.TCP else None,
            receiver=target.receiver or None, codec=target.kv_codec or None, traceparent=traceparent(send)))
        self.streamer.add(rid, handle, target.start_block, len(target.block_ids), send)
        self.chunks.add(rid, span, time.time_ns())
        t0 = time.perf_counter()
        try:
            out = await self._prefill_unless_failed(rid, list(wr.prompt_token_ids), params, wr.salt, handle, key,
                                                    wr.batch)
            self.usage.count(key, prompt_tokens=out.num_prompt_tokens - out.num_cached_tokens,
                             cached_tokens=out.num_cached_tokens)
            t1 = time.perf_counter()
            logprob = out.new_logprobs[0] if out.new_logprobs else 0.0
            handle.finish(out.new_token_ids[0], logprob)
            result = await wait_async(handle, self.transfer_timeout_s)
            self.kv_bytes_sent += result.nbytes
            send.set_attribute("kvrelay.kv.bytes", result.nbytes)
            span.set_attribute("kvrelay.cached_tokens", out.num_cached_tokens)
            resp = wpb.PrefillResponse(first_token_id=out.new_token_ids[0], first_logprob=logprob,
                                       kv_bytes=result.nbytes, prefill_ms=(t1 - t0) * 1e3,
                                       transfer_ms=(time.perf_counter() - t1) * 1e3,
                                       cached_tokens=out.num_cached_tokens, wire_ms=result.wire_s * 1e3,
                                       link_bound=result.link_bound, rtt_ms=result.rtt_s * 1e3,
                                       busy_ms=result.busy_s * 1e3)
            if out.new_top_logprobs:  # the KV transfer carries only the token: the router adds these
                resp.first_top_logprobs.CopyFrom(top_logprobs_proto(out.new_top_logprobs[0]))
            return resp
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVTransferError as exc:
            log.warning("transfer for %s failed: %s", rid, exc.reason)
            send.set_status(Status(StatusCode.ERROR, exc.reason[:300]))
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {exc.reason}")
        finally:
            send.end()
            self.chunks.remove(rid)
            self.streamer.remove(rid)
            handle.fail("prefill ended")  # no-op when DONE; stops queued sends otherwise
            await asyncio.to_thread(handle.quiesce, 10.0)
            # freeing the engine's copy waits for the engine thread's current step: do it
            # after the response is on its way, not before (it would delay the decode's finish)
            self._spawn_cleanup(self.aengine.call(self.engine.abort_request, rid))
