"""``kvrelay bench tls``: what TLS costs a request, against the same build
with TLS off, in one run.

Two clusters of the same config run side by side on this machine: one with
TLS (mutual TLS inside, server TLS to the client), one with ``tls.enabled:
false`` (plaintext on loopback; the same bearer token). Requests alternate
between them (A, B, A, B, ...), so both meet the same machine load. Per
cluster: time to first token of a prompt of N random token ids (distinct per
request, so no prefix-cache hit; long enough to go prefill -> KV -> decode),
and the round trip of a unary gRPC call (``ListModels``, authenticated).
With ``checked``, the TLS cluster lists a revoked serial (one no certificate
has), so every channel of it (client -> router, router -> workers, workers ->
router) goes through the forwarder that checks revocation
(runtime/checked_tls.py): what that check costs. Results as p50/p90; the JSON
field names are stable."""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import ClusterConfig
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

MODES = ("tls", "plaintext")
UNUSED_SERIAL = "1"
"""A revoked serial no certificate of a run has (random serials are 159-bit): it turns the checks on."""


@dataclass(slots=True)
class ModeResult:
    ttft_p50_ms: float
    ttft_p90_ms: float
    rtt_p50_us: float
    rtt_p90_us: float


@dataclass(slots=True)
class TLSBenchResult:
    prompt_tokens: int
    requests: int
    rtt_calls: int
    tls: ModeResult
    plaintext: ModeResult
    checked: bool = False
    """The TLS cluster's channels went through the revocation-checking forwarder."""

    @property
    def ttft_overhead_pct(self) -> float:
        return 100.0 * (self.tls.ttft_p50_ms / self.plaintext.ttft_p50_ms - 1.0)

    @property
    def rtt_overhead_us(self) -> float:
        return self.tls.rtt_p50_us - self.plaintext.rtt_p50_us

    def to_dict(self) -> dict:
        return asdict(self) | {"ttft_overhead_pct": self.ttft_overhead_pct, "rtt_overhead_us": self.rtt_overhead_us}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _ttft_ms(stub, ids: list[int]) -> float:
    t0 = time.perf_counter()
    call = stub.Generate(ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=2, ignore_eos=True),
                         timeout=120)
    first = None
    for msg in call:
        if first is None and msg.token_ids:
            first = time.perf_counter()
    return ((first or time.perf_counter()) - t0) * 1e3


def _rtt_us(stub, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        stub.ListModels(ipb.ListModelsRequest(), timeout=10)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _configs(cfg: ClusterConfig, checked: bool) -> dict[str, ClusterConfig]:
    out = {}
    for mode in MODES:
        c = copy.deepcopy(cfg)
        c.router.port, c.router.http_port = 0, None
        c.tls.enabled = mode == "tls"
        if checked and mode == "tls":
            c.tls.revoked_serials = [*c.tls.revoked_serials, UNUSED_SERIAL]
        out[mode] = c
    return out


def run_tls_bench(cfg: ClusterConfig, model_path: Path, prompt_tokens: int = 256, requests: int = 40,
                  rtt_calls: int = 400, warmup: int = 4, seed: int = 0, checked: bool = False) -> TLSBenchResult:
    """Both clusters up, warmed, then alternating measurements; both stopped after."""
    clusters = {mode: LocalCluster(c, model_path) for mode, c in _configs(cfg, checked).items()}
    try:
        for lc in clusters.values():
            lc.start()
        channels = {m: lc.channel() for m, lc in clusters.items()}
        stubs = {m: igrpc.InferenceStub(ch) for m, ch in channels.items()}
        rng = random.Random(seed)
        ttft: dict[str, list[float]] = {m: [] for m in MODES}
        rtt: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(warmup + requests):
            ids = [rng.randrange(100, 10000) for _ in range(prompt_tokens)]
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                t = _ttft_ms(stubs[mode], ids)
                if i >= warmup:
                    ttft[mode].append(t)
        for _ in range(10):  # interleaved batches of unary calls
            for mode in MODES:
                rtt[mode] += _rtt_us(stubs[mode], max(1, rtt_calls // 10))
        for ch in channels.values():
            ch.close()
    finally:
        for lc in clusters.values():
            lc.stop()
    res = {m: ModeResult(statistics.median(ttft[m]), _pct(ttft[m], 0.9), statistics.median(rtt[m]),
                         _pct(rtt[m], 0.9)) for m in MODES}
    return TLSBenchResult(prompt_tokens, requests, rtt_calls, res["tls"], res["plaintext"], checked)


def format_tls(r: TLSBenchResult) -> str:
    checked = " (revocation checked)" if r.checked else ""
    rows = [f"TLS{checked} vs plaintext, {r.requests} requests of {r.prompt_tokens} prompt tokens each (alternating), "
            f"{r.rtt_calls} ListModels calls each",
            f"{'':10} {'TTFT p50':>10} {'TTFT p90':>10} {'RTT p50':>10} {'RTT p90':>10}"]
    for mode in MODES:
        m: ModeResult = getattr(r, mode)
        rows.append(f"{mode:10} {m.ttft_p50_ms:8.1f}ms {m.ttft_p90_ms:8.1f}ms {m.rtt_p50_us:8.0f}us "
                    f"{m.rtt_p90_us:8.0f}us")
    rows.append(f"TLS adds {r.ttft_overhead_pct:+.1f}% to TTFT p50 and {r.rtt_overhead_us:+.0f} us to a unary call")
    return "\n".join(rows)
