"""Keeping one request alive through worker failures (the failure table in
the README, "When workers fail"), as the router sees them:

- the prefill worker dies, or the transfer fails, times out or fails its
  checksum: the decode worker has released its reservation (the router
  cancels that call); the prompt is placed again without the failed worker,
  once, and after a second failure it is recomputed at a decode worker
  (colocated);
- the decode worker dies mid-stream: the stream moves to another decode
  worker the request's constraints allow, which prefills the prompt plus
  every token already sent and continues from there, so the client sees
  neither a duplicated nor a missing token. Greedy output is identical to an
  uninterrupted run; a seeded sampled stream continues validly, but not
  with the draws it would have made.

:class:`Recovery` holds that state for one request; the router's Generate
loop asks it for the next attempt's work request and passes every client
message through it."""

from __future__ import annotations

import time

from kvrelay.runtime.roles import Role
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

MAX_PREFILL_FAILURES = 2
"""Prefill-side failures of one request: the first is retried on another
worker, the second makes the decode worker recompute the prompt."""
MAX_MIGRATIONS = 3
"""Decode workers one stream may lose before the request fails."""


class Failover(Exception):
    """A worker failed a request in a way another worker may not.

    ``stage`` is PREFILL (the prefill worker or the transfer) or DECODE;
    ``suspect``: the worker itself may be at fault (not, e.g., a link)."""

    def __init__(self, stage: Role, worker_id: str, reason: str, suspect: bool = True) -> None:
        super().__init__(f"{stage} worker {worker_id}: {reason}")
        self.stage = stage
        self.worker_id = worker_id
        self.reason = reason
        self.suspect = suspect


class Recovery:
    """Failure state of one request across its attempts."""

    def __init__(self, wr: wpb.WorkRequest) -> None:
        self.base = wr
        self.emitted: list[int] = []
        """Token ids the client has received."""
        self.exclude: set[str] = set()
        self.prefill_failures = 0
        self.migrations = 0
        self.attempt = 0
        self._t0 = time.perf_counter()
        self._ttft_ms: float | None = None

    def resume(self, ids: list[int]) -> None:
        """The client already has ``ids`` of the answer (from a router that went away): the first
        attempt continues after them, as a migration does."""
        if ids:
            self.emitted, self.attempt = list(ids), 1

    @property
    def exhausted(self) -> bool:
        """Too many failures: the request fails."""
        return self.prefill_failures > MAX_PREFILL_FAILURES or self.migrations > MAX_MIGRATIONS

    @property
    def colocated_only(self) -> bool:
        return self.prefill_failures >= MAX_PREFILL_FAILURES

    def work_request(self) -> wpb.WorkRequest | None:
        """What the next attempt sends to workers; None when the client
        already has every token it asked for."""
        if self.attempt == 0:
            return self.base
        remaining = self.base.max_tokens - len(self.emitted)
        if remaining <= 0:
            return None
        wr = wpb.WorkRequest()
        wr.CopyFrom(self.base)
        wr.prompt_token_ids.extend(self.emitted)
        wr.prior_output_tokens = len(self.emitted)  # still output: penalties, min_tokens, seeds
        wr.max_tokens = remaining
        wr.request_id = f"{self.base.request_id}.{self.attempt}"  # the failed workers may still know the old id
        return wr

    def passed(self, msg: ipb.GenerateResponse) -> ipb.GenerateResponse:
        """Notes a message on its way to the client; fixes its final usage and placement."""
        if msg.token_ids and self._ttft_ms is None:
            self._ttft_ms = (time.perf_counter() - self._t0) * 1e3
        self.emitted.extend(msg.token_ids)
        if msg.HasField("finish"):
            self._complete(msg.finish)
        return msg

    def _complete(self, finish: ipb.Finish) -> None:
        finish.usage.prompt_tokens = len(self.base.prompt_token_ids)
        finish.usage.completion_tokens = len(self.emitted)
        finish.placement.retries = self.prefill_failures
        finish.placement.migrations = self.migrations
        if self._ttft_ms is not None:
            finish.placement.ttft_ms = self._ttft_ms

    def finish_without_worker(self, request_id: str) -> ipb.GenerateResponse:
        """The last message when a decode worker failed after the last token but before its finish."""
        msg = ipb.GenerateResponse(request_id=request_id, finish=ipb.Finish(reason=ipb.FINISH_REASON_LENGTH))
        self._complete(msg.finish)
        return msg

    def failed(self, f: Failover) -> str:
        """Records a failure; returns what happens next (see ``exhausted``)."""
        self.attempt += 1
        self.exclude.add(f.worker_id)
        if f.stage is Role.PREFILL:
            self.prefill_failures += 1
            if self.prefill_failures > MAX_PREFILL_FAILURES:
                return f"giving up: the prompt failed {self.prefill_failures} times, last at {f.worker_id} ({f.reason})"
            then = "recomputing it at a decode worker" if self.colocated_only else "placing it again elsewhere"
            return f"prefill at {f.worker_id} failed ({f.reason}); {then}"
        self.migrations += 1
        if self.migrations > MAX_MIGRATIONS:
            return f"giving up: {self.migrations} decode workers failed, last {f.worker_id} ({f.reason})"
        return (f"decode worker {f.worker_id} failed after {len(self.emitted)} tokens ({f.reason}); "
                "migrating the stream")
