"""``kvrelay bench fuzz --minutes N``: the fuzz targets of
benchmarks/fuzz_targets.py against a real local cluster for a time budget,
then a leak check. The suite runs the same thing bounded
(tests/integration/test_fuzz.py).

Reported per target: cases tried, failures (5xx / gRPC INTERNAL, errors not
in the API's shape, no answer, exceptions other than ConfigError) with the
first examples; then crashes (a process of the cluster died) and leaks, from
samples taken after a warm-up and again after the run has settled: KV blocks
not free at the workers, file descriptors and threads per process, router
RSS before and after."""

from __future__ import annotations

import copy
import json
import logging
import random
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvrelay.benchmarks.fuzz_targets import (
    ConfigTarget,
    GrpcTarget,
    HttpTarget,
    KVTarget,
    Outcome,
)
from kvrelay.benchmarks.machine import machine
from kvrelay.benchmarks.probes import run_probes
from kvrelay.kvtransfer.handshake import SenderHello
from kvrelay.kvtransfer.protection import Protection
from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.kvcreds import CertCredentials
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)

FUZZ_CLUSTER = {
    "router": {"port": 0, "http_port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
               "http": {"max_connections_per_client": 1000}},  # the probes open 500 from one address
    "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
    "scheduler": {"max_model_len": 128},
}
"""The cluster fuzzed: one prefill and one decode worker, a short context so every generation is short."""

FD_SLACK, THREAD_SLACK = 8, 4
"""Growth per process that is not called a leak (pooled connections and threads that come and go)."""
EXAMPLES = 10


@dataclass(slots=True)
class Tally:
    """One target's run."""

    cases: int = 0
    failures: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    """Cases per kind (random bytes, mutated message, ...)."""
    examples: list[str] = field(default_factory=list)
    """The first failures, described."""


@dataclass(slots=True)
class ProcessSample:
    fds: int
    threads: int
    rss_mib: float


@dataclass(slots=True)
class FuzzReport:
    seconds: float
    seed: int
    targets: dict[str, Tally]
    crashes: list[str]
    """Processes of the cluster that died."""
    kv_blocks_held: int
    """KV blocks (and reservations, running requests) not free at the workers after the run."""
    before: dict[str, ProcessSample]
    after: dict[str, ProcessSample]
    machine: dict
    probes: dict | None = None
    """benchmarks/probes.py's figures (bench fuzz runs them first)."""

    def leaks(self) -> list[str]:
        """What grew past the slack, described."""
        out = [f"{self.kv_blocks_held} KV blocks not freed"] if self.kv_blocks_held else []
        for name, b in self.before.items():
            a = self.after.get(name)
            if a is None:
                continue
            if a.fds - b.fds > FD_SLACK:
                out.append(f"{name}: {a.fds - b.fds} more file descriptors")
            if a.threads - b.threads > THREAD_SLACK:
                out.append(f"{name}: {a.threads - b.threads} more threads")
        return out

    def ok(self) -> bool:
        return not self.crashes and not self.leaks() and not any(t.failures for t in self.targets.values())

    def to_json(self) -> dict:
        d = asdict(self)
        d["leaks"] = self.leaks()
        d["ok"] = self.ok()
        d["router_rss_growth_mib"] = round(self.after["router"].rss_mib - self.before["router"].rss_mib, 1) \
            if "router" in self.after and "router" in self.before else None
        return d


def _sample(pid: int) -> ProcessSample | None:
    try:
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return ProcessSample(fds, int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024)


def _samples(cluster: LocalCluster) -> dict[str, ProcessSample]:
    out = {}
    for c in cluster.children:
        s = _sample(c.proc.pid)
        if s is not None:
            out[c.name] = s
    return out


def _held_blocks(cluster: LocalCluster, settle_s: float = 30.0) -> int:
    """KV blocks, reservations and running requests still held at the workers once they settle (0: none)."""
    until = time.monotonic() + settle_s
    while True:
        held = 0
        with cluster.channel(operator=True) as ch:
            listed = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10).workers
        for w in listed:
            with cluster.worker_channel(w.info) as ch:
                stub = wgrpc.DecodeWorkerStub(ch) if w.info.role == wpb.ROLE_DECODE else wgrpc.PrefillWorkerStub(ch)
                s = stub.Stats(wpb.StatsRequest(), timeout=10)
            held += (s.total_blocks - s.free_blocks) + s.reservations + s.running
        if held == 0 or time.monotonic() > until:
            return held
        time.sleep(0.5)


def targets_for(cluster: LocalCluster, model: str, workdir: Path) -> list:
    """Every target, aimed at ``cluster``."""
    with cluster.channel(operator=True) as ch:
        listed = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10).workers
    decode = next(w.info for w in listed if w.info.role == wpb.ROLE_DECODE)
    creds = None
    if cluster.creds is not None:
        creds = CertCredentials(cluster.creds.material(Identity(decode.site, CertRole.PREFILL, "fuzz")),
                                (CertRole.DECODE,))
    hello = SenderHello(cluster.kv_secret, decode.layout_hash, creds, Protection.AEAD, receiver=decode.worker_id)
    return [HttpTarget(cluster.http_address, str(cluster.ca_file), cluster.client_token, model),
            GrpcTarget(cluster.channel(), cluster.client_token),
            KVTarget(decode.kv_endpoint, hello),
            ConfigTarget(copy.deepcopy(FUZZ_CLUSTER), workdir / "fuzzed.yaml")]


def _drive(targets: list, seconds: float, seed: int, tallies: dict[str, Tally]) -> None:
    """Round-robin over ``targets`` until ``seconds`` pass."""
    rngs = {t.name: random.Random(f"{seed}:{t.name}") for t in targets}
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for t in targets:
            try:
                out = t.one(rngs[t.name])
            except Exception as exc:  # a bug of the fuzzer's own is reported, not fatal
                out = Outcome("fuzzer error", f"the fuzzer itself raised {type(exc).__name__}: {exc}"[:300])
            tally = tallies.setdefault(t.name, Tally())
            tally.cases += 1
            tally.kinds[out.kind] = tally.kinds.get(out.kind, 0) + 1
            if out.failure is not None:
                tally.failures += 1
                if len(tally.examples) < EXAMPLES:
                    tally.examples.append(out.failure)
                log.warning("fuzz %s: %s", t.name, out.failure)


def fuzz_cluster(cluster: LocalCluster, seconds: float, seed: int = 0, model: str = "SmolLM2-135M-Instruct"
                 ) -> FuzzReport:
    """Fuzzes a running ``cluster`` for ``seconds`` (after a short warm-up), then checks for crashes and leaks."""
    with tempfile.TemporaryDirectory(prefix="kvrelay-fuzz-") as tmp:
        targets = targets_for(cluster, model, Path(tmp))
        _drive(targets, min(10.0, seconds / 10), seed + 1_000_003, {})  # warm-up: pools and caches fill
        _held_blocks(cluster)
        before = _samples(cluster)
        tallies: dict[str, Tally] = {}
        t0 = time.monotonic()
        _drive(targets, seconds, seed, tallies)
        elapsed = time.monotonic() - t0
        held = _held_blocks(cluster)
        time.sleep(2.0)  # connections the run closed are closed at the other end too
        after = _samples(cluster)
    crashes = [f"{c.name} exited with {c.proc.poll()}" for c in cluster.dead_children()]
    return FuzzReport(round(elapsed, 1), seed, tallies, crashes, held, before, after, machine())


def run_fuzz_bench(model_path: str, minutes: float, seed: int = 0) -> FuzzReport:
    """``kvrelay bench fuzz``: a cluster of its own, fuzzed for ``minutes``."""
    lc = LocalCluster(parse_config(copy.deepcopy(FUZZ_CLUSTER)), model_path, reconcile=False)
    lc.start()
    try:
        probes = run_probes(lc, lc.cfg.router.http.header_timeout_s)
        report = fuzz_cluster(lc, minutes * 60, seed, Path(model_path).name)
        report.probes = probes.to_json()
        return report
    finally:
        lc.stop()


def format_fuzz(r: FuzzReport) -> str:
    lines = [f"## kvrelay bench fuzz: {r.seconds:.0f} s, seed {r.seed}, {r.machine.get('cpu', '?')}", "",
             "| target | cases | failures | kinds |", "|---|---:|---:|---|"]
    for name, t in r.targets.items():
        kinds = ", ".join(f"{k} {n}" for k, n in Counter(t.kinds).most_common())
        lines.append(f"| {name} | {t.cases} | {t.failures} | {kinds} |")
    for name, t in r.targets.items():
        lines += [f"- {name}: {e}" for e in t.examples]
    rss = r.to_json()["router_rss_growth_mib"]
    lines += ["", f"crashes: {len(r.crashes)} {r.crashes or ''}", f"KV blocks held after: {r.kv_blocks_held}",
              f"leaks: {r.leaks() or 'none'}", f"router RSS: {r.before['router'].rss_mib:.0f} -> "
              f"{r.after['router'].rss_mib:.0f} MiB ({rss:+.1f})" if "router" in r.after else "router: gone",
              "fds / threads per process (before -> after): " + ", ".join(
                  f"{n} {b.fds}->{r.after[n].fds} / {b.threads}->{r.after[n].threads}"
                  for n, b in r.before.items() if n in r.after)]
    if r.probes:
        lines += ["", "probes: " + ", ".join(f"{k} {v}" for k, v in r.probes.items())]
    return "\n".join(lines)


def fuzz_json(r: FuzzReport) -> str:
    return json.dumps(r.to_json(), indent=2)
