"""The router's view of its workers: registration, heartbeats with load,
health (a worker silent for ``timeout_s`` is unhealthy) and gRPC stubs."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import grpc

from cluster.worker_runtime import GRPC_OPTIONS
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc


@dataclass(slots=True)
class WorkerRecord:
    info: wpb.WorkerInfo
    load: wpb.WorkerLoad
    last_seen: float
    channel: grpc.aio.Channel
    stub: object
    draining: bool = False
    inflight: int = 0
    """Requests the router has on this worker now (exact, unlike heartbeats)."""

    @property
    def score(self) -> int:
        return self.inflight + self.load.waiting


class WorkerRegistry:
    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.workers: dict[str, WorkerRecord] = {}
        self._rr = itertools.count()

    async def register(self, info: wpb.WorkerInfo) -> None:
        old = self.workers.pop(info.worker_id, None)
        if old is not None:
            await old.channel.close()
        channel = grpc.aio.insecure_channel(info.address, options=GRPC_OPTIONS)
        stub = (wgrpc.PrefillWorkerStub(channel) if info.role == wpb.ROLE_PREFILL
                else wgrpc.DecodeWorkerStub(channel))
        self.workers[info.worker_id] = WorkerRecord(info, wpb.WorkerLoad(worker_id=info.worker_id),
                                                    time.monotonic(), channel, stub)

    def heartbeat(self, load: wpb.WorkerLoad) -> bool:
        rec = self.workers.get(load.worker_id)
        if rec is None:
            return False
        rec.load = load
        rec.last_seen = time.monotonic()
        return True

    def healthy(self, rec: WorkerRecord) -> bool:
        return time.monotonic() - rec.last_seen <= self.timeout_s

    def candidates(self, role: int, sites: set[str] | None = None) -> list[WorkerRecord]:
        """Healthy, non-draining workers of ``role`` (at ``sites`` when given)."""
        return [w for w in self.workers.values()
                if w.info.role == role and not w.draining and self.healthy(w)
                and (sites is None or w.info.site in sites)]

    def pick(self, role: int, sites: set[str] | None = None) -> WorkerRecord | None:
        """Least loaded candidate; ties broken round-robin."""
        cands = self.candidates(role, sites)
        if not cands:
            return None
        turn = next(self._rr)
        best = min(w.score for w in cands)
        tied = [w for w in cands if w.score == best]
        return tied[turn % len(tied)]

    async def close(self) -> None:
        for rec in self.workers.values():
            await rec.channel.close()
