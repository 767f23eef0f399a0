"""`kvrelay bench replay` against a real gRPC server (kvrelay.v1.Inference)
that refuses requests as overloaded (RESOURCE_EXHAUSTED with trailing
``retry-after-ms``) a set number of times: the replay waits as advised
(never less, within the request's deadline), resends at most
``overload_retries`` times, and reports the resends and the requests shed."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import grpc
import pytest

from kvrelay.benchmarks.replay import (
    ReplayConfig,
    _overload_lines,
    build_report,
    replay,
    retry_after_s,
)
from kvrelay.benchmarks.traces import ScaledRequest, TraceRequest
from kvrelay.runtime.rpc import PLAINTEXT, bind, create_server
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

HINT_MS = 150
PLAN = {  # request id -> (times refused, retry-after-ms or None)
    "replay-0": (2, str(HINT_MS)),  # succeeds on the third send
    "replay-1": (99, "20"),  # refused every time: shed after 5 resends
    "replay-2": (99, "10000"),  # the advised wait is past the deadline: shed at once
    "replay-3": (99, None),  # no hint: nothing to go by, shed at once
    "replay-4": (0, None),  # never refused
}
TIMEOUT_S = 3.0


class Overloaded(igrpc.InferenceServicer):
    """Refuses each request as PLAN says, then streams its max_tokens tokens."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        """Request id -> when each send arrived."""
        self.refused: dict[str, list[float]] = defaultdict(list)
        """Request id -> when each refusal went out."""

    async def Generate(self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.calls[request.request_id].append(time.perf_counter())
        times, hint = PLAN[request.request_id]
        if len(self.calls[request.request_id]) <= times:
            if hint is not None:
                context.set_trailing_metadata((("retry-after-ms", hint),))
            self.refused[request.request_id].append(time.perf_counter())
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "every eligible decode worker is full")
        for i in range(request.max_tokens):
            last = i == request.max_tokens - 1
            yield ipb.GenerateResponse(request_id=request.request_id, token_ids=[7],
                                       finish=ipb.Finish(usage=ipb.Usage(completion_tokens=i + 1)) if last else None)


async def _replay_against(server_impl: Overloaded):
    server = create_server()
    igrpc.add_InferenceServicer_to_server(server_impl, server)
    port = bind(server, "127.0.0.1", 0, None)
    await server.start()
    reqs = [ScaledRequest(TraceRequest(i, 0.0, 4, 2), [1, 2, 3, 4], 2) for i in range(len(PLAN))]
    cfg = ReplayConfig(request_timeout_s=TIMEOUT_S, sample_interval_s=0.2, progress=False)
    try:  # no Registry there: the load sampler gets UNIMPLEMENTED and samples nothing
        records, samples = await replay(f"127.0.0.1:{port}", reqs, cfg, PLAINTEXT, PLAINTEXT)
    finally:
        await server.stop(None)
    return records, build_report(records, samples, cfg, {})


def test_overload_refusals_are_waited_out_as_advised_and_counted():
    srv = Overloaded()
    records, report = asyncio.run(_replay_against(srv))
    ok, always, late, blind, fine = records
    # refused twice, then served: each resend came at least the advised wait after its refusal
    assert ok.error is None and ok.overload_retries == 2 and len(ok.token_times) == 2
    sends, refusals = srv.calls["replay-0"], srv.refused["replay-0"]
    gaps = [b - a for a, b in zip(refusals, sends[1:])]
    assert len(sends) == 3 and all(HINT_MS / 1e3 <= g < HINT_MS / 1e3 * 1.1 + 1.0 for g in gaps), gaps
    assert 2 * HINT_MS / 1e3 <= ok.overload_wait_s <= 2 * HINT_MS / 1e3 * 1.1 + 1e-6
    assert 2 * HINT_MS / 1e3 <= ok.e2e < 2 * HINT_MS / 1e3 * 1.1 + 2.0  # latency counts from the first send
    # refused every time: the first send and 5 resends, then shed
    assert len(srv.calls["replay-1"]) == 6 and always.overload_retries == 5
    assert always.error.startswith("RESOURCE_EXHAUSTED:") and always.end_s is None
    # a wait past the deadline, or no hint: not resent
    assert len(srv.calls["replay-2"]) == len(srv.calls["replay-3"]) == 1
    assert late.overload_retries == blind.overload_retries == 0 and late.error and blind.error
    assert fine.error is None and fine.overload_retries == 0 and len(srv.calls["replay-4"]) == 1
    s = report["summary"]
    assert (s["retried_429"], s["retried_429_requests"], s["shed"]) == (7, 2, 3)
    assert s["completed"] == 2 and s["failed"] == 3 and s["overload_wait_s"] >= 2 * HINT_MS / 1e3 + 5 * 0.02
    assert report["requests"][0]["overload_retries"] == 2  # per request, in report.json too
    line = _overload_lines(s)[0]
    assert "7 resends after the advised wait (2 requests" in line and "3 requests shed" in line


@pytest.mark.parametrize("metadata,expected", [
    ((("retry-after-ms", "250"),), 0.25),
    ((("other", "1"), ("retry-after-ms", "0")), 0.0),
    ((("retry-after-ms", "soon"),), None),
    ((("retry-after-ms", "-5"),), None),
    ((("retry-after-ms", "nan"),), None),
    ((), None),
])
def test_the_retry_hint_is_read_only_when_it_is_a_wait(metadata, expected):
    exc = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                               grpc.aio.Metadata(*metadata), "full")
    assert retry_after_s(exc) == expected
