"""``kvrelay bench telemetry``: what tracing every request costs, against
the same build with telemetry off, in one run.

Two clusters of the same config (one prefill and one decode worker, never
colocated, so every request goes prefill -> KV -> decode): one with
``telemetry.traces: none``, one with ``traces: file`` at ``sample_ratio``
1.0. They are started one after the other, then measured in alternating
rounds (off, traced, traced, off, ...: linear drift cancels), one request at
a time, so only one cluster works at any moment; both stay up throughout,
so both meet the same background. Each cluster gets the same requests
(random token ids, distinct per request: no prefix-cache hit; ``max_tokens``
forced with ``ignore_eos``). Per request: TTFT (first token - sent) and
decode tokens/s ((completion tokens - 1) / (last token - first token));
reported as medians. The JSON field names are stable."""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvrelay.benchmarks.machine import machine
from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.tracing import read_spans
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

MODES = ("off", "traced")


def cluster_config(traced: bool, span_dir: Path) -> dict:
    """The cluster of one mode (``span_dir``: where the traced one writes its span files)."""
    telemetry = ({"traces": "file", "file": str(span_dir / "{process}.jsonl"), "sample_ratio": 1.0}
                 if traced else {"traces": "none"})
    return {"router": {"port": 0, "http_port": None,
                       "placement": {"policy": "least_loaded", "colocate_below_tokens": 0}},
            "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1},
                       "decode": {"replicas": 1}}],
            "workers": {"threads": 1}, "cache": {"memory_gib": 0.25}, "telemetry": telemetry}


@dataclass(slots=True)
class TelemetryConfig:
    requests: int = 24
    """Measured requests per cluster."""
    prompt_tokens: int = 200
    max_tokens: int = 32
    round_size: int = 4
    """Requests per round (a round is one cluster's turn)."""
    warmup: int = 2
    """Unmeasured requests per cluster first."""
    seed: int = 0


@dataclass(slots=True)
class Sample:
    ttft_s: float
    decode_tok_s: float | None
    """None when the tokens came in one message (no decode interval to time)."""
    trace_id: str


def one_request(stub, ids: list[int], max_tokens: int) -> Sample:
    """Sends one request and times its tokens."""
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = last = None
    tokens, trace_id = 0, ""
    for msg in stub.Generate(req, timeout=300):
        now = time.perf_counter()
        if msg.token_ids:
            first = first if first is not None else now
            last, tokens = now, tokens + len(msg.token_ids)
        if msg.HasField("finish"):
            trace_id = msg.finish.placement.trace_id
    if first is None or last is None or tokens != max_tokens:  # last: set with first
        raise RuntimeError(f"got {tokens} tokens, asked for {max_tokens}")
    rate = (tokens - 1) / (last - first) if last > first else None
    return Sample(first - t0, rate, trace_id)


def round_order(cfg: TelemetryConfig) -> list[tuple[str, range]]:
    """(mode, request indexes) per round: each chunk of requests to both
    clusters, the order flipping every chunk (off, traced, traced, off, ...)."""
    out = []
    for k, lo in enumerate(range(0, cfg.requests, cfg.round_size)):
        chunk = range(lo, min(cfg.requests, lo + cfg.round_size))
        out += [(m, chunk) for m in (MODES if k % 2 == 0 else MODES[::-1])]
    return out


def summarize(samples: list[Sample]) -> dict:
    rates = [s.decode_tok_s for s in samples if s.decode_tok_s is not None]
    return {"ttft_p50_s": statistics.median(s.ttft_s for s in samples),
            "decode_tok_s": statistics.median(rates) if rates else None}


def _measure(stubs: dict, cfg: TelemetryConfig) -> dict[str, list[Sample]]:
    """The warm-up, then the rounds; checks every traced request has a trace and no other does."""
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(cfg.prompt_tokens)]
               for _ in range(cfg.requests + cfg.warmup)]
    for mode in MODES:
        for ids in prompts[cfg.requests:]:
            one_request(stubs[mode], ids, cfg.max_tokens)
    samples: dict[str, list[Sample]] = {m: [] for m in MODES}
    for mode, chunk in round_order(cfg):
        samples[mode] += [one_request(stubs[mode], prompts[i], cfg.max_tokens) for i in chunk]
    if any(len(s.trace_id) != 32 for s in samples["traced"]) or any(s.trace_id for s in samples["off"]):
        raise RuntimeError("traced requests must carry a trace id and the others none")
    return samples


def run_telemetry_bench(model_path: str, cfg: TelemetryConfig) -> dict:
    """Both clusters started one after the other, measured in alternating rounds, stopped; the report."""
    with tempfile.TemporaryDirectory(prefix="kvrelay-telemetry-") as tmp:
        span_dir = Path(tmp)
        clusters: dict[str, LocalCluster] = {}
        try:
            for mode in MODES:
                clusters[mode] = LocalCluster(parse_config(cluster_config(mode == "traced", span_dir)), model_path)
                clusters[mode].start()
            channels = {m: lc.channel() for m, lc in clusters.items()}
            try:
                samples = _measure({m: igrpc.InferenceStub(ch) for m, ch in channels.items()}, cfg)
            finally:
                for ch in channels.values():
                    ch.close()
        finally:
            for lc in clusters.values():
                lc.stop()  # the traced processes export what is left as they stop
        spans = len(read_spans(sorted(span_dir.glob("*.jsonl"))))
    return report(samples, cfg, spans)


def report(samples: dict[str, list[Sample]], cfg: TelemetryConfig, spans_written: int) -> dict:
    """The JSON report: per mode its medians, the overheads (> 0: tracing is slower), the machine."""
    off, traced = summarize(samples["off"]), summarize(samples["traced"])
    decode = (1 - traced["decode_tok_s"] / off["decode_tok_s"]
              if traced["decode_tok_s"] and off["decode_tok_s"] else None)
    return {"machine": machine(), "off": off, "traced": traced,
            "ttft_overhead": traced["ttft_p50_s"] / off["ttft_p50_s"] - 1, "decode_overhead": decode,
            "requests": cfg.requests, "prompt_tokens": cfg.prompt_tokens, "max_tokens": cfg.max_tokens,
            "spans_written": spans_written}


def format_telemetry(r: dict) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:+.1%}"

    def rate(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f}"

    rows = [f"tracing (file, sample ratio 1.0) vs telemetry off: {r['requests']} requests each of "
            f"{r['prompt_tokens']} prompt tokens, {r['max_tokens']} output tokens (alternating rounds)",
            f"{'':8} {'TTFT p50':>10} {'decode tok/s':>13}"]
    for mode in MODES:
        rows.append(f"{mode:8} {r[mode]['ttft_p50_s'] * 1e3:8.1f}ms {rate(r[mode]['decode_tok_s']):>13}")
    rows.append(f"with tracing: TTFT p50 {pct(r['ttft_overhead'])} longer, decode tokens/s "
                f"{pct(r['decode_overhead'])} lower (goal: under 3% each); {r['spans_written']} spans written")
    return "\n".join(rows)
