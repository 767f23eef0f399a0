"""Fault injection beside a replay (``kvrelay bench replay --chaos RATE``).

A :class:`Chaos` thread injects faults at random (Poisson) times into a
running :class:`~launch.local.LocalCluster`:

- ``kill_prefill`` / ``kill_decode``: SIGKILL of a random worker of that
  role, preferring one with requests in flight; the launcher's reconciler
  starts a replacement;
- ``cut_link``: every packet on an emulated link between two cities is
  dropped for ``link_down_s`` (only with ``--cities``);
- ``restart_router``: SIGKILL of the router (with several, one at random), started again on its address;
  workers register again, and clients retry the streams it broke.

:func:`compare` then checks the chaos run against a fault-free run of the
same requests: nothing lost, every (greedy) output identical, and what the
faults cost (retries, migrations, recomputes, added latency).
"""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.benchmarks.metrics import RequestRecord
from kvrelay.launch import cities
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

if TYPE_CHECKING:
    from kvrelay.launch.local import LocalCluster

log = logging.getLogger(__name__)

KINDS = {"kill_prefill": 3, "kill_decode": 3, "cut_link": 2, "restart_router": 1}
"""Fault kinds and their relative frequency: a router restart breaks every
stream in flight (clients send those again), so it is the rarest."""


@dataclass(slots=True)
class ChaosConfig:
    rate_per_min: float
    """Mean faults per minute (exponential gaps)."""
    seed: int = 0
    link_down_s: float = 3.0
    """How long a cut link stays down."""
    kinds: dict[str, int] = field(default_factory=lambda: dict(KINDS))
    """Kinds to inject, with their weights."""


@dataclass(slots=True)
class FaultRecord:
    at_s: float
    """When it was injected, from the start of the chaos run."""
    kind: str
    target: str
    took_s: float = 0.0
    """How long injecting it took (a router restart waits for the new one to be ready)."""


@dataclass(slots=True)
class Chaos:
    """Injects faults into ``cluster`` from a thread until stopped."""

    cluster: LocalCluster
    cfg: ChaosConfig
    state_dir: Path | None = None
    """The `kvrelay cities` state folder, for cutting links (None: no link faults)."""
    faults: list[FaultRecord] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0

    def start(self) -> None:
        if self.cfg.rate_per_min <= 0:
            raise ValueError(f"chaos rate must be positive, got {self.cfg.rate_per_min}")
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._thread.start()

    def stop(self) -> list[FaultRecord]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)
        return self.faults

    def _kinds(self) -> dict[str, int]:
        links = self.state_dir is not None and self.cluster.cities is not None and self.cluster.cfg.links
        return {k: n for k, n in self.cfg.kinds.items() if k != "cut_link" or links}

    def _run(self) -> None:
        rng = random.Random(self.cfg.seed)
        kinds = self._kinds()
        while not self._stop.wait(rng.expovariate(self.cfg.rate_per_min / 60.0)):
            kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
            t = time.monotonic()
            try:
                target = getattr(self, f"_{kind}")(rng)
            except (OSError, RuntimeError, ValueError) as exc:
                log.warning("chaos: %s failed: %s", kind, exc)
                continue
            if target is None:
                continue
            self.faults.append(FaultRecord(t - self._t0, kind, target, time.monotonic() - t))
            log.info("chaos: %s %s", kind, target)

    def _busy(self) -> set[str]:
        """Workers the router has requests on now (empty when it cannot say)."""


        try:
            with self.cluster.channel(operator=True) as ch:
                workers = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=2.0).workers
        except grpc.RpcError:
            return set()
        return {w.info.worker_id for w in workers if w.inflight > 0}

    def _kill(self, role: str, rng: random.Random) -> str | None:
        """SIGKILL of a random registered worker of ``role``, among those with
        requests in flight when there are any (so the kill tests recovery)."""
        live = self.cluster.live_workers(role)
        if not live:
            return None
        busy = self._busy()
        victim = rng.choice([c for c in live if c.name in busy] or live)
        victim.proc.kill()
        return victim.name + (" (busy)" if victim.name in busy else " (idle)")

    def _kill_prefill(self, rng: random.Random) -> str | None:
        return self._kill("prefill", rng)

    def _kill_decode(self, rng: random.Random) -> str | None:
        return self._kill("decode", rng)

    def _cut_link(self, rng: random.Random) -> str | None:
        if self.state_dir is None:  # _kinds leaves link cuts out then
            raise ValueError("links are cut only in a `kvrelay cities` emulation (no state folder)")

        a, b = rng.choice(self.cluster.cfg.links).between
        cities.link_signal(self.state_dir, a, b, cut=True)
        try:
            self._stop.wait(self.cfg.link_down_s)
        finally:
            cities.link_signal(self.state_dir, a, b, cut=False)
        return f"{a}-{b} for {self.cfg.link_down_s:g} s"

    def _restart_router(self, rng: random.Random) -> str:
        """SIGKILL one router (with several, one of them at random) and start it again."""
        names = sorted(r.name for r in self.cluster.cfg.routers)
        name = rng.choice(names) if names else ""
        self.cluster.restart_router(kill=True, name=name)
        return f"router {name}" if name else "router"


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"count": 0}
    xs = sorted(xs)
    return {"count": len(xs), "mean": statistics.fmean(xs), "p50": xs[len(xs) // 2],
            "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "max": xs[-1]}


def _added_s(pairs: list[tuple[RequestRecord, RequestRecord]]) -> list[float]:
    """E2E seconds the faults added: each request's less its fault-free run's (both completed)."""
    return [r.e2e - b.e2e for r, b in pairs if r.e2e is not None and b.e2e is not None]


def compare(base: Sequence[RequestRecord], chaos: Sequence[RequestRecord], faults: list[FaultRecord]) -> dict:
    """What the faults cost, request by request against the fault-free run."""
    by_index = {r.index: r for r in base}
    lost = [r.index for r in chaos if not r.ok]
    # a request the fault-free run did not complete (shed for good, over capacity) has no output to compare
    differ = [r.index for r in chaos if r.ok and by_index[r.index].ok and r.token_ids != by_index[r.index].token_ids]
    affected = [r for r in chaos if r.ok and (r.placement.get("retries") or r.placement.get("migrations")
                                              or r.client_retries)]
    added = _added_s([(r, by_index[r.index]) for r in chaos])
    added_hit = _added_s([(r, by_index[r.index]) for r in affected])
    kinds: dict[str, int] = {}
    for f in faults:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    return {
        "requests": len(chaos), "lost": lost, "outputs_differ": differ,
        "baseline_failed": [r.index for r in base if not r.ok],
        "faults": len(faults), "faults_by_kind": kinds,
        "router_retries": sum(r.placement.get("retries", 0) for r in chaos),
        "migrations": sum(r.placement.get("migrations", 0) for r in chaos),
        "client_retries": sum(r.client_retries for r in chaos),
        "recomputed_requests": len(affected),
        "added_e2e_s_all": _dist(added), "added_e2e_s_affected": _dist(added_hit),
        "ttft_s_mean": {"baseline": statistics.fmean([r.ttft for r in base if r.ok and r.ttft is not None] or [0]),
                        "chaos": statistics.fmean([r.ttft for r in chaos if r.ok and r.ttft is not None] or [0])},
        "fault_log": [{"at_s": round(f.at_s, 2), "kind": f.kind, "target": f.target, "took_s": round(f.took_s, 2)}
                      for f in faults],
    }


def router_counters(metrics_address: str, timeout_s: float = 5.0) -> dict[str, int] | None:
    """The router's own retry and migration counters from its /metrics (kept across
    its restarts in the usage database, unlike the placements of requests in flight
    when it was killed); None when it serves no metrics or cannot be read."""
    if not metrics_address:
        return None
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8")
    except OSError as exc:
        log.warning("the router's metrics at %s could not be read: %s", metrics_address, exc)
        return None
    values = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
              if f.name in ("kvrelay_retries", "kvrelay_migrations") and f.samples}
    return {"retries": int(values.get("kvrelay_retries", 0)), "migrations": int(values.get("kvrelay_migrations", 0))}


def comparison_markdown(c: dict) -> str:
    def d(x: dict) -> str:
        if not x.get("count"):
            return "n/a"
        return (f"mean {x['mean']:+.2f} s, p50 {x['p50']:+.2f}, p90 {x['p90']:+.2f}, max {x['max']:+.2f} "
                f"(n={x['count']})")

    kinds = ", ".join(f"{k} {n}" for k, n in sorted(c["faults_by_kind"].items())) or "none"
    lines = [
        "# Chaos replay against the fault-free run", "",
        f"- requests: {c['requests']}; lost: {len(c['lost'])}; outputs different from the fault-free run: "
        f"{len(c['outputs_differ'])}" + (f" (indexes {c['outputs_differ'][:20]})" if c["outputs_differ"] else "")
        + (f"; not compared: {len(c['baseline_failed'])} the fault-free run did not complete "
           f"(indexes {c['baseline_failed'][:20]})" if c["baseline_failed"] else ""),
        f"- faults injected: {c['faults']} ({kinds})",
        f"- router retries (prefill side): {c['router_retries']}; stream migrations: {c['migrations']}; "
        f"client retries (router restarts): {c['client_retries']}; requests that needed any: "
        f"{c['recomputed_requests']}",
        *([f"- the router's own counters (exact across its restarts): retries {c['router_counters']['retries']}, "
           f"migrations {c['router_counters']['migrations']}"] if c.get("router_counters") else []),
        f"- mean TTFT: fault-free {c['ttft_s_mean']['baseline']:.3f} s, chaos {c['ttft_s_mean']['chaos']:.3f} s",
        f"- added end-to-end latency, all requests: {d(c['added_e2e_s_all'])}",
        f"- added end-to-end latency, requests that needed recovery: {d(c['added_e2e_s_affected'])}",
        "", "| at (s) | fault | target |", "|---|---|---|",
    ]
    lines += [f"| {f['at_s']:.1f} | {f['kind']} | {f['target']} |" for f in c["fault_log"]]
    return "\n".join(lines) + "\n"
