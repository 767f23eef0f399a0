"""One attempt of one request on its placement, in named steps:

1. **reserve**: open the decode worker D's ``Decode`` stream; D reserves KV
   blocks and answers with a reservation (or, colocated, computes the prompt
   itself and streams tokens at once);
2. **prefill**: on the reservation, call the prefill worker P's ``Prefill``
   with it as the KV target (plus what the link between P and D asks for);
3. **relay**: stream D's tokens to the caller, watching P's call and the link
   the KV crosses while it moves;
4. **finish**: complete the last message with P's figures, the placement and
   usage, and feed the planner.

Failures become data: :class:`~kvrelay.router.core.recovery.Failover` (another worker may
succeed), :class:`~kvrelay.router.placement.errors.PlacementError` (D had no room: nothing
was sent yet), or :class:`~kvrelay.router.core.errors.RouterError` (the request fails).
Leaving the attempt, by any path, cancels both worker calls, which free their
blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry.trace import INVALID_SPAN, Span

from kvrelay.router.cluster.planner import RequestWindow, Served
from kvrelay.router.cluster.registry import WorkerRecord, WorkerRegistry
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.recovery import Failover
from kvrelay.router.core.requests import Caller
from kvrelay.router.placement.codec_choice import choose_codec
from kvrelay.router.placement.errors import PlacementError, PlacementFailure, Wait
from kvrelay.router.placement.estimate import prefill_s
from kvrelay.router.placement.link_estimate import Crossing, LinkSample
from kvrelay.runtime.config import LinkSection
from kvrelay.runtime.roles import Role
from kvrelay.runtime.topology import AUTO, KVCodec, Topology, link_name
from kvrelay.runtime.tracing import metadata_for
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
"""Worker errors that another worker may not have (a crash, a failed transfer, a lease)."""

WORKER_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID, grpc.StatusCode.OUT_OF_RANGE: ErrorKind.INVALID,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION: ErrorKind.CONSTRAINT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.OVERLOADED, grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.DEADLINE, grpc.StatusCode.CANCELLED: ErrorKind.CANCELLED,
}
"""A worker's final status -> what the request's caller is told (anything else: INTERNAL)."""

WORKER_FULL_RETRY_S = 1.0
"""Retry hint when the chosen decode worker turned out to have no room."""
FIRST_TOP_LOGPROBS_WAIT_S = 10.0
"""Longest wait for P's answer (which carries the first token's top_logprobs) once D has the KV."""


def placement_proto(est_ttft_s: float, policy: str, cached_prefill: int, cached_decode: int,
                    p: WorkerRecord | None, d: WorkerRecord) -> ipb.Placement:
    """What the caller is told of a placement (the measured fields are filled in later)."""
    return ipb.Placement(
        decode_worker=d.info.worker_id, decode_site=d.info.site, prefill_worker=(p or d).info.worker_id,
        prefill_site=(p or d).info.site, colocated=p is None, estimated_ttft_ms=est_ttft_s * 1e3,
        policy=policy, prefill_cached_blocks=cached_prefill, decode_cached_blocks=cached_decode,
        link="" if p is None else link_name(p.info.site, d.info.site))


def _worker_error(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or "worker failed"
    return grpc.StatusCode.INTERNAL, str(exc)


@dataclass(frozen=True, slots=True)
class RelayContext:
    """What every attempt relays through, the same for all of them (built once by the core)."""

    registry: WorkerRegistry
    topology: Topology
    window: RequestWindow
    """Finished requests, the planner's figures."""
    lease_s: float
    """How long D holds KV blocks reserved for a transfer that has not arrived (router.liveness.kv_lease_s)."""
    on_release: Callable[[], None] | None = None
    """Called (soon after) when an attempt gives its workers' capacity back."""


class Relay:
    """Runs one attempt: ``async for msg in Relay(...).run()``."""

    def __init__(self, ctx: RelayContext, wr: wpb.WorkRequest, client_id: str, p: WorkerRecord | None,
                 d: WorkerRecord, placement: ipb.Placement, caller: Caller, span: Span = INVALID_SPAN) -> None:
        """``span``: the attempt's (the workers' spans become its children)."""
        self.span = span
        self.metadata = metadata_for(span)
        self.wr, self.client_id, self.p, self.d = wr, client_id, p, d
        self.on_release = ctx.on_release
        self.held = False
        self.placement, self.caller = placement, caller
        self.registry, self.topology, self.window, self.lease_s = ctx.registry, ctx.topology, ctx.window, ctx.lease_s
        self.n_out = 0
        self.t0 = self.t_first = time.perf_counter()
        self.prefiller = p or d
        self.pending = 0
        """Prompt tokens this router has queued at the prefilling worker (less those its prefix
        cache holds: what it will compute), known at once (heartbeats lag); released with the
        first token."""
        self.call = None
        self.read: asyncio.Future | None = None
        self.prefill: asyncio.Future | None = None
        self.link_down: asyncio.Future | None = None
        self.crossing: Crossing | None = None
        """This attempt's KV on its link, for the link's estimate (router/placement/link_estimate.py)."""

    async def run(self) -> AsyncIterator[ipb.GenerateResponse]:
        """The attempt's messages for the caller; raises Failover, PlacementError or RouterError.
        Holds the workers' capacity from :meth:`hold` (or from here) to its end."""
        self.hold()
        try:
            self._reserve()
            while True:
                ev = await self._next_event()
                if ev is grpc.aio.EOF:
                    return
                if ev.HasField("reservation"):
                    self._start_prefill(ev.reservation)
                    continue
                if self.n_out == 0:
                    await self._first_top_logprobs(ev.output)
                out = self._relay(ev.output)
                if out.HasField("finish"):
                    async for msg in self._finish(out):
                        yield msg
                else:
                    yield out
        except grpc.aio.AioRpcError as exc:
            raise self._decode_failed(exc) from None
        finally:
            self.release()

    # -- the steps ------------------------------------------------------------------------------------------------
    def _reserve(self) -> None:
        """Opens D's Decode stream; its first answer is a reservation, or tokens when colocated."""
        self.call = self.d.decode_stub.Decode(wpb.DecodeRequest(
            request=self.wr, colocated=self.p is None, lease_s=self.lease_s, link=self.placement.link,
            sender=self.p.info.worker_id if self.p is not None else ""),  # the only one D takes its KV from
            metadata=self.metadata)
        # KV crossing a link between sites: if the link goes down meanwhile, re-place at once
        # (the transfer would otherwise stall until its timeout)
        if self.p is not None:
            down = self.registry.link_down_event(self.p.info.site, self.d.info.site)
            if down is not None:
                self.link_down = asyncio.ensure_future(down.wait())

    def _start_prefill(self, target: wpb.KVTarget) -> None:
        """Calls P.Prefill with D's reservation plus what the link between them asks for."""
        p = self._p()
        link = self.topology.link(p.info.site, self.d.info.site)
        if link is None:  # placement pairs only sites that exchange KV
            raise RuntimeError(f"{self.client_id}: sites {p.info.site} and {self.d.info.site} have no link")
        target.link_rtt_ms, target.link_gbps = link.rtt_ms, link.gbps
        target.protection = self.topology.protection(link)
        lv = self.registry.link_view(p.info.site, self.d.info.site)
        gbps = lv.gbps if lv is not None else link.gbps  # measured once its transfers say so, else the config's
        self.placement.link_gbps = gbps
        self.placement.link_rate_source = self.registry.meter.source(self.placement.link).value
        # the codec for this transfer's share of the link, beside the transfers in flight on it
        codec = self._codec(link, len(target.block_ids), lv.kv_gbps(False) if lv is not None else gbps)
        target.kv_codec = codec.value if codec.lossy else ""
        self.placement.kv_codec = codec.value
        target.receiver = self.d.info.worker_id  # the receiver's certificate must name it
        # the sender's kind decides unless the link pins one (tcp = bytes over the socket)
        target.transport = self.topology.transport(link, p.info.transport)
        self.placement.transport = target.transport
        self.span.add_event("kvrelay.reservation", {"kvrelay.kv.blocks": len(target.block_ids),
                                                    "kvrelay.transport": target.transport})
        call = p.prefill_stub.Prefill(wpb.PrefillRequest(request=self.wr, target=target), metadata=self.metadata)
        self.prefill = asyncio.ensure_future(call)
        self.crossing = self.registry.meter.begin(self.placement.link, time.monotonic())

    def _codec(self, link: LinkSection, blocks: int, gbps: float) -> KVCodec:
        """The KV codec of this request's ``blocks`` over ``link``: the link's, or under ``auto`` the one
        router/placement/codec_choice.py picks for P's estimated prefill (its queue, then the prompt's
        tokens P does not hold, at its measured throughput) at the link's rate in use, ``gbps``."""
        codec = self.topology.codec(link, self.wr.tenant)
        if codec != AUTO:
            return KVCodec(codec)
        p = self._p()
        tput = p.load.prefill_tokens_per_s or self.topology.cfg.router.placement.default_prefill_tokens_per_s
        compute_s = prefill_s(p.load.queued_prefill_tokens, len(self.wr.prompt_token_ids),
                              self.placement.prefill_cached_blocks, p.info.block_size, tput)
        return choose_codec(self.topology.auto_codecs(), self.topology.fraction, blocks * p.info.kv_block_bytes,
                            gbps, compute_s, p.info.num_layers)

    def _relay(self, out: ipb.GenerateResponse) -> ipb.GenerateResponse:
        """One message from D on its way to the caller."""
        out.request_id = self.client_id
        if self.n_out == 0 and out.token_ids:
            self.t_first = time.perf_counter()
            self.placement.ttft_ms = (self.t_first - self.t0) * 1e3
            self.span.add_event("kvrelay.first_token")
            self.prefiller.pending_prefill_tokens -= self.pending
            self.pending = 0
        self.n_out += len(out.token_ids)
        return out

    async def _first_top_logprobs(self, out: ipb.GenerateResponse) -> None:
        """Disaggregated: D knows only the first token and its logprob (from the KV transfer); its
        top_logprobs come with P's answer, which follows the receiver's ack. Lost with P: left empty."""
        if self.prefill is None or not self.wr.sampling.top_logprobs or not out.top_logprobs \
                or out.top_logprobs[0].token_ids:
            return
        try:  # P answers right after D acknowledged the KV; shielded: the call itself stays ours to finish
            resp = await asyncio.wait_for(asyncio.shield(self.prefill), FIRST_TOP_LOGPROBS_WAIT_S)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            log.warning("%s: the first token's top_logprobs are missing (%s)", self.client_id, type(exc).__name__)
            return
        out.top_logprobs[0].CopyFrom(resp.first_top_logprobs)

    async def _finish(self, out: ipb.GenerateResponse) -> AsyncIterator[ipb.GenerateResponse]:
        """D's last message, completed with P's figures, usage and placement."""
        if self.prefill is not None and not self.prefill.done() and out.token_ids:
            # the prefill worker's figures come a little later: do not hold the tokens for them
            early = ipb.GenerateResponse()
            early.CopyFrom(out)
            early.ClearField("finish")
            yield early
            for f in ("token_ids", "logprobs", "top_logprobs", "text"):
                out.ClearField(f)
        if self.prefill is not None:
            try:
                resp = await self.prefill
            except grpc.aio.AioRpcError:  # every token is here; only P's figures are lost
                resp = wpb.PrefillResponse()
            self.placement.kv_bytes = resp.kv_bytes
            self.placement.kv_transfer_ms, self.placement.prefill_ms = resp.transfer_ms, resp.prefill_ms
            self._measure_link(resp)
            out.finish.usage.cached_prompt_tokens = max(out.finish.usage.cached_prompt_tokens, resp.cached_tokens)
        out.finish.usage.completion_tokens = self.n_out
        out.finish.placement.CopyFrom(self.placement)
        self._feed_planner()
        yield out

    def _measure_link(self, resp: wpb.PrefillResponse) -> None:
        """The transfer's time on the wire, for the link's estimate (router/placement/link_estimate.py)."""
        now = time.monotonic()
        share = self.registry.meter.end(self.crossing, now)
        sample = LinkSample.of(now, resp.kv_bytes, resp.wire_ms, resp.rtt_ms, resp.link_bound, share, resp.busy_ms)
        self.placement.link_measured_gbps, self.placement.link_bound = sample.gbps * share, sample.bound
        if sample.gbps > 0:
            self.registry.meter.observe(self.placement.link, sample)

    def _feed_planner(self) -> None:
        if not self.n_out:
            return
        n = self.n_out
        self.window.add(Served(
            time.monotonic(), self.prefiller.info.site, Role.PREFILL if self.p is not None else Role.DECODE,
            self.d.info.site, len(self.wr.prompt_token_ids), self.placement.ttft_ms / 1e3,
            (time.perf_counter() - self.t_first) / (n - 1) if n > 1 else None))

    # -- waiting and failing ----------------------------------------------------------------------------------------
    def _kv_moving(self) -> bool:
        return self.n_out == 0 and (self.prefill is None or not self.prefill.done())

    async def _next_event(self):
        """D's next message; meanwhile a failed prefill or a link that went down ends the attempt."""
        while True:
            self.read = self.read or asyncio.ensure_future(self.call.read())
            waiting = {self.read}
            if self.prefill is not None and not self.prefill.done():
                waiting.add(self.prefill)
            if self.link_down is not None and self._kv_moving():
                waiting.add(self.link_down)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not self.read.done():
                self._check_sides()
                continue
            ev, self.read = self.read.result(), None
            return ev

    def _check_sides(self) -> None:
        """Raises when the KV cannot arrive: its link went down, or P failed."""
        if self.link_down is not None and self.link_down.done() and self._kv_moving():
            raise Failover(Role.PREFILL, self._p().info.worker_id, f"link {self.placement.link} went down",
                           suspect=False)
        failed = self.prefill.exception() if self.prefill is not None and self.prefill.done() else None
        if failed is not None:
            code, details = _worker_error(failed)
            if code in RETRYABLE:
                raise Failover(Role.PREFILL, self._p().info.worker_id, f"{code.name}: {details}")
            kind = ErrorKind.INVALID if code == grpc.StatusCode.INVALID_ARGUMENT else ErrorKind.UNAVAILABLE
            raise RouterError(kind, f"prefill failed: {details}")

    def _p(self) -> WorkerRecord:
        """P, whom only an attempt that is not colocated calls (and watches)."""
        if self.p is None:
            raise RuntimeError(f"{self.client_id}: a colocated attempt has no prefill worker")
        return self.p

    def _decode_failed(self, exc: grpc.aio.AioRpcError) -> Exception:
        """What D's failed stream means for the request."""
        code, details = _worker_error(exc)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.prefill is None and self.n_out == 0:
            return PlacementError(PlacementFailure.CAPACITY, details, retry_after_s=WORKER_FULL_RETRY_S,
                                  wait=Wait.ROOM)
        if code in RETRYABLE:
            remaining = self.caller.time_remaining()
            if remaining is not None and remaining <= 0:
                return RouterError(ErrorKind.DEADLINE, details)
            if self.p is not None and self.n_out == 0 and code in (grpc.StatusCode.ABORTED,
                                                                    grpc.StatusCode.DEADLINE_EXCEEDED):
                # D gave up on the KV (transfer failed, checksum, lease): the prefill side failed
                return Failover(Role.PREFILL, self.p.info.worker_id, f"{code.name}: {details}")
            return Failover(Role.DECODE, self.d.info.worker_id, f"{code.name}: {details}")
        return RouterError(WORKER_STATUS.get(code, ErrorKind.INTERNAL), details)

    # -- what the attempt holds -------------------------------------------------------------------------------------
    def hold(self) -> None:
        """Counts this attempt on its workers at once (before anything is sent), so the next placement sees it."""
        if self.held:
            return
        self.held = True
        self.d.inflight += 1
        if self.p is not None:
            self.p.inflight += 1
        pl = self.placement  # the prompt's leading blocks the prefilling worker holds need no computing
        cached = pl.prefill_cached_blocks if self.p is not None else pl.decode_cached_blocks
        self.pending = max(0, len(self.wr.prompt_token_ids) - cached * self.prefiller.info.block_size)
        self.prefiller.pending_prefill_tokens += self.pending

    def release(self) -> None:
        """Gives the capacity back and stops both worker calls (idempotent)."""
        if not self.held:
            return
        self.held = False
        if self.on_release is not None:
            asyncio.get_running_loop().call_soon(self.on_release)
        self.d.inflight -= 1
        if self.p is not None:
            self.p.inflight -= 1
        self.prefiller.pending_prefill_tokens -= self.pending
        self.pending = 0
        self.registry.meter.end(self.crossing, time.monotonic())
        for t in (self.read, self.prefill, self.link_down):
            if t is not None and not t.done():
                t.cancel()
        if self.call is not None:
            self.call.cancel()
