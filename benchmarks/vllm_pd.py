"""``kvrelay bench vllm-pd``: vLLM alone against kvrelay's prefill/decode with
vLLM pools and with builtin pools, in one run, on the same trace slice, the
same machine and the same client (issue 34).

The client is vLLM's own, ``vllm bench serve`` (openai backend,
``/v1/completions``, streamed), on a custom dataset made from the first
``requests`` rows of an Azure trace: each prompt's token count scaled by
``length_scale`` (capped at ``max_prompt_tokens``), its output the trace's
(capped at ``max_output_tokens``), its text decoded from seeded random
token ids, every request sent at ``request_rate`` per second (Poisson,
seeded). Each system serves SmolLM2-135M-Instruct (the embedded model) in
float32 on this machine's cores:

- ``vllm_alone``: ``vllm serve`` (one engine, no disaggregation);
- ``vllm_nixl_pd``: vLLM's own disaggregation, a prefill and a decode
  ``vllm serve`` with its NixlConnector behind a proxy
  (benchmarks/vllm_nixl.py);
- ``kvrelay_vllm``: kvrelay, one prefill and one decode worker running vLLM,
  KV over kvrelay's sealed TCP transport (never colocated);
- ``kvrelay_builtin``: the same cluster with kvrelay's own engine.

Per system: vLLM's client figures (TTFT, TPOT, output throughput), the KV
bytes the decode workers received, and, after the load, the exposed
transfer tail of ``tail_prompts`` prompts of ``tail_prompt_tokens`` sent one
at a time over gRPC (the transfer time after the prefill ended, against the
prefill time). The JSON field names are stable."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.benchmarks import vllm_nixl
from kvrelay.benchmarks.machine import machine
from kvrelay.benchmarks.traces import load_trace
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.launch import vllm_env
from kvrelay.launch.local import LocalCluster
from kvrelay.router.core.auth import token_sha256
from kvrelay.runtime.addresses import free_port
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

SYSTEMS = ("vllm_alone", "vllm_nixl_pd", "kvrelay_vllm", "kvrelay_builtin")
TOKEN = "bench-vllm-pd-token"
MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 600.0


@dataclass(slots=True)
class VllmPdConfig:
    trace: Path
    requests: int = 16
    length_scale: float = 0.25
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 32
    request_rate: float = 0.5
    tail_prompts: int = 3
    tail_prompt_tokens: int = 2000
    kv_cache_gib: float = 0.5
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS
    """Which of :data:`SYSTEMS` to run, in this order."""


@dataclass(slots=True)
class SystemResult:
    name: str
    completed: int = 0
    failed: int = 0
    median_ttft_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    median_tpot_ms: float = 0.0
    output_throughput_tok_s: float = 0.0
    duration_s: float = 0.0
    kv_bytes: int | None = None
    """KV bytes the decode workers received during the load (None: no transfer in this system)."""
    tail_prefill_ms: list[float] = field(default_factory=list)
    tail_transfer_ms: list[float] = field(default_factory=list)
    """Per tail prompt: the prefill's time and the transfer's time after it (the exposed tail)."""
    error: str = ""


def dataset(cfg: VllmPdConfig, tok: Tokenizer, path: Path) -> tuple[int, int]:
    """Writes the custom dataset; (prompt tokens, output tokens) in all."""
    rows = load_trace(cfg.trace, limit=cfg.requests)
    rng = random.Random(cfg.seed)
    total_in = total_out = 0
    with path.open("w") as f:
        for r in rows:
            n_in = max(16, min(cfg.max_prompt_tokens, round(r.input_tokens * cfg.length_scale)))
            n_out = max(1, min(cfg.max_output_tokens, r.output_tokens))
            text = tok.decode([rng.randrange(1000, 40000) for _ in range(n_in)])
            f.write(json.dumps({"prompt": text, "output_tokens": n_out}) + "\n")
            total_in, total_out = total_in + n_in, total_out + n_out
    return total_in, total_out


def bench_client(base_url: str, model: Path, data: Path, cfg: VllmPdConfig, out: Path,
                 env: dict[str, str]) -> dict:
    """``vllm bench serve`` against ``base_url``: its saved result."""
    args = ["bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", MODEL_NAME, "--tokenizer", str(model), "--dataset-name", "custom", "--dataset-path", str(data),
            "--custom-output-len", "-1", "--skip-chat-template", "--num-prompts", str(cfg.requests),
            "--request-rate", str(cfg.request_rate), "--seed", str(cfg.seed), "--ignore-eos", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {**os.environ, **env, "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-m", "kvrelay.launch.vllm_env", "cli", *args], env=env,
                         capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {res.stdout[-1500:]} {res.stderr[-1500:]}")
    return json.loads(out.read_text())


def _fill(r: SystemResult, b: dict) -> None:
    r.completed, r.failed = int(b["completed"]), int(b.get("failed", 0))
    r.median_ttft_ms, r.p99_ttft_ms = b["median_ttft_ms"], b["p99_ttft_ms"]
    r.median_tpot_ms, r.output_throughput_tok_s = b["median_tpot_ms"], b["output_throughput"]
    r.duration_s = b["duration"]


def _serve(model: Path, cfg: VllmPdConfig, log: Path, extra: list[str],
           env: dict[str, str]) -> tuple[int, subprocess.Popen]:
    """A ``vllm serve`` of the model as every system here serves it (its log in ``log``): its port and process."""
    port = free_port()
    args = ["serve", str(model), "--served-model-name", MODEL_NAME, "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
            "--kv-cache-memory-bytes", str(int(cfg.kv_cache_gib * 2**30)), *extra]
    # vLLM's own thread count for serving on CPU (it lowers an unset OMP_NUM_THREADS to 1, against spin-wait
    # contention with its API server; every core measured worse here: RESULTS.md), unless ``env`` sets one
    inherited = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env = {**inherited, "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1", **env}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvrelay.launch.vllm_env", "cli", *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    return port, proc


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_vllm_alone(model: Path, cfg: VllmPdConfig, data: Path, work: Path) -> SystemResult:
    r = SystemResult("vllm_alone")
    port, proc = _serve(model, cfg, work / "vllm_serve.log", [], {})
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, work / "vllm_serve.log")
        _fill(r, bench_client(f"http://127.0.0.1:{port}", model, data, cfg, work / "vllm_alone.json", {}))
    finally:
        _stop([proc])
    return r


def run_vllm_nixl_pd(model: Path, cfg: VllmPdConfig, data: Path, work: Path) -> SystemResult:
    """vLLM's own P/D: a prefill and a decode ``vllm serve`` with NixlConnector behind the proxy
    of benchmarks/vllm_nixl.py; UCX without InfiniBand (none here)."""
    r = SystemResult("vllm_nixl_pd")
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for role in ("prefill", "decode"):
            # no pinning of cores: two instances share them (as kvrelay's vLLM workers do)
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_MODULES": "^ib",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
            log = work / f"vllm_nixl_{role}.log"
            port, proc = _serve(model, cfg, log, ["--kv-transfer-config", vllm_nixl.kv_transfer_config()], env)
            procs.append(proc)
            _wait_http(f"http://127.0.0.1:{port}/health", proc, log)
            urls.append(f"http://127.0.0.1:{port}")
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "kvrelay.benchmarks.vllm_nixl", "--port", str(port),
                                       "--prefill", urls[0], "--decode", urls[1]]))
        _wait_http(f"http://127.0.0.1:{port}/health", procs[-1], None)
        before = _nixl_bytes(urls[1])
        _fill(r, bench_client(f"http://127.0.0.1:{port}", model, data, cfg, work / "vllm_nixl_pd.json", {}))
        r.kv_bytes = _nixl_bytes(urls[1]) - before
    finally:
        _stop(procs)
    return r


def _nixl_bytes(url: str) -> int:
    """KV bytes a vLLM decode instance pulled over NIXL (its ``vllm:nixl_bytes_transferred`` histogram's sum)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "vllm:nixl_bytes_transferred_sum"))


def _wait_http(url: str, proc: subprocess.Popen, log: Path | None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:] if log is not None else ""
            raise RuntimeError(f"{url.rsplit('/', 1)[0]} exited with {proc.returncode} while starting: {tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer within {START_TIMEOUT_S:g} s")


def kvrelay_config(engine: str, cfg: VllmPdConfig) -> dict:
    pool: dict = {"replicas": 1}
    if engine == "vllm":
        pool |= {"engine": "vllm", "vllm": {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_gib": cfg.kv_cache_gib}}
    return {"router": {"port": 0, "http_port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
                       "admission": {"max_inflight_per_worker": 256}},
            "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": dict(pool), "decode": dict(pool)}],
            "cache": {"memory_gib": cfg.kv_cache_gib}, "kv": {"transport": "tcp"},
            "scheduler": {"max_model_len": MAX_MODEL_LEN},
            "tenants": [{"name": "bench", "token_sha256": token_sha256(TOKEN)}]}


def run_kvrelay(engine: str, model: Path, cfg: VllmPdConfig, data: Path, work: Path) -> SystemResult:
    r = SystemResult(f"kvrelay_{engine}")
    lc = LocalCluster(parse_config(kvrelay_config(engine, cfg)), model)
    lc.start()
    try:
        before = _kv_received(lc)
        env = {"OPENAI_API_KEY": TOKEN, "SSL_CERT_FILE": str(lc.ca_file)}
        _fill(r, bench_client(f"https://{lc.http_address}", model, data, cfg, work / f"{r.name}.json", env))
        r.kv_bytes = _kv_received(lc) - before
        _tails(lc, cfg, r)
    finally:
        lc.stop()
    return r


def _kv_received(lc: LocalCluster) -> int:
    with lc.channel(operator=True) as ch:
        ws = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10).workers
    return sum(w.load.kv_bytes_received for w in ws)


def _tails(lc: LocalCluster, cfg: VllmPdConfig, r: SystemResult) -> None:
    """The exposed transfer tail of long prompts, one at a time."""
    rng = random.Random(cfg.seed + 1)
    with lc.channel() as ch:
        stub = igrpc.InferenceStub(ch)
        for _ in range(cfg.tail_prompts):
            ids = [rng.randrange(1000, 40000) for _ in range(cfg.tail_prompt_tokens)]
            msgs = list(stub.Generate(ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=2,
                                                          ignore_eos=True), timeout=600,
                                    metadata=[("authorization", f"Bearer {TOKEN}")]))
            pl = msgs[-1].finish.placement
            r.tail_prefill_ms.append(pl.prefill_ms)
            r.tail_transfer_ms.append(pl.kv_transfer_ms)


def run_vllm_pd_bench(model: Path, cfg: VllmPdConfig) -> dict:
    """Every system of ``cfg.systems`` in turn; a system that fails is reported with its error."""
    tok = Tokenizer(model)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-vllm-pd-") as tmp:
        work = Path(tmp)
        data = work / "dataset.jsonl"
        total_in, total_out = dataset(cfg, tok, data)
        runs = {"vllm_alone": lambda: run_vllm_alone(model, cfg, data, work),
                "vllm_nixl_pd": lambda: run_vllm_nixl_pd(model, cfg, data, work),
                "kvrelay_vllm": lambda: run_kvrelay("vllm", model, cfg, data, work),
                "kvrelay_builtin": lambda: run_kvrelay("builtin", model, cfg, data, work)}
        for name in cfg.systems:
            try:
                results.append(asdict(runs[name]()))
            except (RuntimeError, OSError, subprocess.SubprocessError, grpc.RpcError) as exc:
                results.append(asdict(SystemResult(name, error=f"{type(exc).__name__}: {exc}"[:2000])))
    cfg_out = asdict(cfg) | {"trace": str(cfg.trace)}
    return {"machine": machine(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
            "vllm_version": vllm_env.installed_version(),
            "model": MODEL_NAME, "dtype": "float32", "config": cfg_out, "prompt_tokens": total_in,
            "output_tokens": total_out, "systems": results}


def format_vllm_pd(report: dict) -> str:
    rows = ["| system | completed | median TTFT ms | p99 TTFT ms | median TPOT ms | output tok/s | KV bytes | "
            "exposed tail / prefill (2k prompts) |", "|---|---|---|---|---|---|---|---|"]
    for s in report["systems"]:
        if s["error"]:
            rows.append(f"| {s['name']} | error: {s['error'][:200]} | | | | | | |")
            continue
        tail = ""
        if s["tail_prefill_ms"]:
            ratio = statistics.median(t / p for t, p in zip(s["tail_transfer_ms"], s["tail_prefill_ms"]) if p > 0)
            tail = (f"{statistics.median(s['tail_transfer_ms']):.1f} ms / "
                    f"{statistics.median(s['tail_prefill_ms']):.0f} ms ({ratio:.1%})")
        kv = "" if s["kv_bytes"] is None else f"{s['kv_bytes'] / 2**20:.1f} MiB"
        rows.append(f"| {s['name']} | {s['completed']}/{s['completed'] + s['failed']} | {s['median_ttft_ms']:.0f} | "
                    f"{s['p99_ttft_ms']:.0f} | {s['median_tpot_ms']:.1f} | {s['output_throughput_tok_s']:.1f} | "
                    f"{kv} | {tail} |")
    return "\n".join(rows)
