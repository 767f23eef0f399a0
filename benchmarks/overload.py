"""``kvrelay bench overload``: the router at several times the rate it can
sustain, to show that it sheds what it cannot serve in time instead of
queueing it, and that what it admits keeps its time to first token.

1. **Capacity**: a closed loop of ``concurrency`` clients for
   ``capacity_s``; the completed requests per second are the sustainable rate.
2. **Overload**: Poisson arrivals at ``factor`` times that rate for
   ``overload_s``, each request on its own (no resends).

Reported: admitted (completed) versus shed (RESOURCE_EXHAUSTED, with or
without the ``retry-after-ms`` hint) versus other errors; TTFT of the
admitted against the router's configured SLO (``router.pools.slo_ttft_s``); the
router's RSS (before, peak, after); whether every process is still alive."""

from __future__ import annotations

import asyncio
import copy
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from kvrelay.benchmarks.machine import machine
from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

OVERLOAD_CLUSTER = {
    "router": {"port": 0, "http_port": None, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
               "admission": {"max_inflight_per_worker": 8, "admission_wait_s": 0.5}, "pools": {"slo_ttft_s": 2.0}},
    "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
}
"""One prefill and one decode worker; at most 8 requests on a worker, and a
request waits at most 0.5 s for room (a quarter of the 2 s TTFT objective)."""


@dataclass(slots=True)
class OverloadConfig:
    factor: float = 5.0
    """Offered rate during the overload, in multiples of the measured sustainable rate."""
    overload_s: float = 60.0
    capacity_s: float = 30.0
    concurrency: int = 8
    """Closed-loop clients while the capacity is measured (the admission bound of the one decode worker)."""
    prompt_tokens: int = 64
    output_tokens: int = 16
    seed: int = 0


@dataclass(slots=True)
class Shot:
    """One request of the overload phase."""

    sent_s: float
    ttft_s: float | None = None
    done_s: float | None = None
    status: str = "OK"
    retry_after_ms: int | None = None


@dataclass(slots=True)
class OverloadReport:
    sustainable_rps: float
    offered_rps: float
    sent: int
    admitted: int
    shed: int
    shed_with_retry_after: int
    other_errors: dict[str, int]
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_max_s: float | None
    slo_ttft_s: float
    admitted_within_slo: float
    """Fraction of admitted requests whose TTFT met the SLO."""
    router_rss_mib: dict[str, float]
    crashed: list[str]
    config: dict
    machine: dict = field(default_factory=machine)

    def to_json(self) -> dict:
        return asdict(self)


def _request(cfg: OverloadConfig, rng: random.Random) -> ipb.GenerateRequest:
    ids = [rng.randrange(100, 40000) for _ in range(cfg.prompt_tokens)]
    return ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=cfg.output_tokens, ignore_eos=True)


async def _one(stub, req: ipb.GenerateRequest, metadata, t0: float) -> Shot:
    shot = Shot(time.monotonic() - t0)
    try:
        async for msg in stub.Generate(req, timeout=120, metadata=metadata):
            if shot.ttft_s is None and msg.token_ids:
                shot.ttft_s = time.monotonic() - t0 - shot.sent_s
        shot.done_s = time.monotonic() - t0
    except grpc.aio.AioRpcError as exc:
        shot.status = exc.code().name
        hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms")
        shot.retry_after_ms = int(hint) if hint is not None and str(hint).isdigit() else None
    return shot


async def _capacity(stub, metadata, cfg: OverloadConfig, rng: random.Random) -> float:
    """Completed requests per second of ``cfg.concurrency`` closed-loop clients."""
    until, done = time.monotonic() + cfg.capacity_s, []

    async def client() -> None:
        while time.monotonic() < until:
            shot = await _one(stub, _request(cfg, rng), metadata, time.monotonic())
            if shot.status == "OK":
                done.append(time.monotonic())

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(cfg.concurrency)))
    return len(done) / (time.monotonic() - t0)


async def _overload(stub, metadata, cfg: OverloadConfig, rate: float, rng: random.Random) -> list[Shot]:
    """Poisson arrivals at ``rate`` for ``cfg.overload_s``; every request's outcome."""
    t0, tasks, at = time.monotonic(), [], 0.0
    while at < cfg.overload_s:
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(stub, _request(cfg, rng), metadata, t0)))
        at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0.5, 0.9, ...) of ``values``, inclusive method; None when empty."""
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1] if len(values) > 1 else values[0]


def _report(shots: list[Shot], sustainable: float, offered: float, slo: float, rss: dict, crashed: list[str],
            cfg: OverloadConfig) -> OverloadReport:
    ok = [s for s in shots if s.status == "OK"]
    shed = [s for s in shots if s.status == "RESOURCE_EXHAUSTED"]
    other: dict[str, int] = {}
    for s in shots:
        if s.status not in ("OK", "RESOURCE_EXHAUSTED"):
            other[s.status] = other.get(s.status, 0) + 1
    ttft = sorted(s.ttft_s for s in ok if s.ttft_s is not None)
    within = sum(t <= slo for t in ttft) / len(ttft) if ttft else 0.0
    return OverloadReport(round(sustainable, 3), round(offered, 3), len(shots), len(ok), len(shed),
                          sum(s.retry_after_ms is not None for s in shed), other,
                          quantile(ttft, 0.5), quantile(ttft, 0.9), quantile(ttft, 0.99), ttft[-1] if ttft else None,
                          slo, round(within, 4), rss, crashed, asdict(cfg))


def overload_cluster(cluster: LocalCluster, cfg: OverloadConfig) -> OverloadReport:
    """Measures the sustainable rate of a running ``cluster``, then offers ``cfg.factor`` times it."""
    pid = next(c for c in cluster.children if c.name == "router").proc.pid
    rss = {"before": _rss_mib(pid), "peak": 0.0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss["peak"] = max(rss["peak"], _rss_mib(pid))
            time.sleep(0.05)

    async def run() -> tuple[float, list[Shot]]:
        rng = random.Random(cfg.seed)
        metadata = ()  # the dialer sends the tenant's token
        async with cluster.client_dialer.aio(cluster.router_address) as ch:
            stub = igrpc.InferenceStub(ch)
            rate = await _capacity(stub, metadata, cfg, rng)
            return rate, await _overload(stub, metadata, cfg, max(0.1, rate * cfg.factor), rng)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        rate, shots = asyncio.run(run())
    finally:
        stop.set()
        sampler.join()
    time.sleep(2.0)
    rss["after"] = _rss_mib(pid)
    crashed = [f"{c.name} exited with {c.proc.poll()}" for c in cluster.dead_children()]
    return _report(shots, rate, rate * cfg.factor, cluster.cfg.router.pools.slo_ttft_s, rss, crashed, cfg)


def run_overload_bench(model_path: str, cfg: OverloadConfig, raw: dict | None = None) -> OverloadReport:
    """``kvrelay bench overload``: a cluster of its own (``raw``: its config, default OVERLOAD_CLUSTER)."""
    lc = LocalCluster(parse_config(copy.deepcopy(raw or OVERLOAD_CLUSTER)), Path(model_path), reconcile=False)
    lc.start()
    try:
        return overload_cluster(lc, cfg)
    finally:
        lc.stop()


def format_overload(r: OverloadReport) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    return "\n".join([
        f"## kvrelay bench overload ({r.machine.get('cpu', '?')})", "",
        f"sustainable rate: {r.sustainable_rps:.2f} req/s; offered {r.offered_rps:.2f} req/s "
        f"({r.config['factor']:g}x) for {r.config['overload_s']:g} s",
        f"sent {r.sent}: admitted {r.admitted}, shed {r.shed} ({r.shed_with_retry_after} with retry-after-ms), "
        f"other errors {r.other_errors or 'none'}",
        f"TTFT of admitted: p50 {s(r.ttft_p50_s)}, p90 {s(r.ttft_p90_s)}, p99 {s(r.ttft_p99_s)}, "
        f"max {s(r.ttft_max_s)}; within the {r.slo_ttft_s:g} s SLO: {r.admitted_within_slo:.1%}",
        f"router RSS: {r.router_rss_mib['before']:.0f} MiB before, {r.router_rss_mib['peak']:.0f} peak, "
        f"{r.router_rss_mib.get('after', 0):.0f} after; crashed: {r.crashed or 'none'}"])
