"""``kvrelay bench fairness``: one tenant's interactive time to first token
while another tenant's batch job saturates the cluster, against the same
requests on the idle cluster.

1. **Idle**: tenant ``lab-b`` sends ``interactive`` requests one after
   another; their TTFT is the baseline.
2. **Loaded**: tenant ``lab-a`` submits a batch job far larger than the
   cluster can run at once (``job_concurrency`` above the decode worker's
   admission bound, so its requests queue at the router); once it runs,
   ``lab-b`` sends the same requests again.

Reported: TTFT p50/p90 idle and loaded and their ratio, and how many of the
job's requests finished meanwhile (the job did progress: the cluster was
shared, not handed over)."""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass, field

import grpc

from kvrelay.benchmarks.machine import machine
from kvrelay.benchmarks.overload import quantile
from kvrelay.launch.local import LocalCluster
from kvrelay.router.core.auth import token_sha256
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import jobs_pb2_grpc as jgrpc

TOKENS = {"lab-a": "fairness-batch-tenant", "lab-b": "fairness-interactive-tenant"}
FAIRNESS_CLUSTER = {
    "router": {"port": 0, "http_port": None, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
               "admission": {"max_inflight_per_worker": 8, "job_concurrency": 16}},
    "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
    "tenants": [{"name": name, "token_sha256": token_sha256(tok)} for name, tok in TOKENS.items()],
}
"""One prefill and one decode worker taking 8 requests each; the job runner
keeps 16 of lab-a's requests going, so half of them wait at the router."""


@dataclass(slots=True)
class FairnessConfig:
    interactive: int = 12
    """lab-b's requests, one after another, in each phase."""
    prompt_tokens: int = 96
    output_tokens: int = 4
    job_requests: int = 400
    job_output_tokens: int = 24
    seed: int = 0


@dataclass(slots=True)
class FairnessReport:
    idle_ttft_s: list[float]
    loaded_ttft_s: list[float]
    job_finished_meanwhile: int
    machine: dict = field(default_factory=machine)

    def summary(self) -> dict:
        idle90, loaded90 = quantile(self.idle_ttft_s, 0.9), quantile(self.loaded_ttft_s, 0.9)
        if idle90 is None or loaded90 is None:
            raise ValueError("no time to first token was measured (idle or loaded)")
        return {"idle_ttft_p50_s": quantile(self.idle_ttft_s, 0.5), "idle_ttft_p90_s": idle90,
                "loaded_ttft_p50_s": quantile(self.loaded_ttft_s, 0.5), "loaded_ttft_p90_s": loaded90,
                "p90_ratio": loaded90 / idle90, "job_finished_meanwhile": self.job_finished_meanwhile}

    def to_json(self) -> dict:
        return asdict(self) | self.summary()


def _prompt(cfg: FairnessConfig, rng: random.Random, max_tokens: int) -> ipb.GenerateRequest:
    ids = [rng.randrange(100, 40000) for _ in range(cfg.prompt_tokens)]
    return ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=max_tokens, ignore_eos=True)


def _ttfts(stub, cfg: FairnessConfig, rng: random.Random) -> list[float]:
    out = []
    for _ in range(cfg.interactive):
        t0 = time.perf_counter()
        for msg in stub.Generate(_prompt(cfg, rng, cfg.output_tokens), timeout=120):
            if msg.token_ids:
                out.append(time.perf_counter() - t0)
                break
        time.sleep(0.05)
    return out


def _finished(jobs, job_id: str) -> int:
    j = jobs.GetJob(jpb.GetJobRequest(id=job_id), timeout=30)
    return j.completed + j.failed


def fairness_on(lc: LocalCluster, cfg: FairnessConfig) -> FairnessReport:
    """Both phases on a running cluster whose tenants include lab-a and lab-b (TOKENS)."""
    rng = random.Random(cfg.seed)
    with lc.dialer(TOKENS["lab-b"]).sync(lc.router_address) as b_ch, \
            lc.dialer(TOKENS["lab-a"]).sync(lc.router_address) as a_ch:
        b, jobs = igrpc.InferenceStub(b_ch), jgrpc.JobsStub(a_ch)
        _ttfts(b, FairnessConfig(interactive=2, prompt_tokens=cfg.prompt_tokens), rng)  # warm-up
        idle = _ttfts(b, cfg, rng)
        job = jobs.SubmitJob(jpb.SubmitJobRequest(name="flood", requests=[
            _prompt(cfg, rng, cfg.job_output_tokens) for _ in range(cfg.job_requests)]), timeout=60)
        try:
            deadline = time.monotonic() + 60
            while _finished(jobs, job.id) < 8 and time.monotonic() < deadline:  # running at full tilt
                time.sleep(0.2)
            before = _finished(jobs, job.id)
            loaded = _ttfts(b, cfg, rng)
            meanwhile = _finished(jobs, job.id) - before
        finally:
            try:
                jobs.CancelJob(jpb.CancelJobRequest(id=job.id), timeout=30)
            except grpc.RpcError:
                pass
    return FairnessReport(idle, loaded, meanwhile)


def run_fairness_bench(model_path: str, cfg: FairnessConfig) -> FairnessReport:
    lc = LocalCluster(parse_config(copy.deepcopy(FAIRNESS_CLUSTER)), model_path)
    lc.start()
    try:
        return fairness_on(lc, cfg)
    finally:
        lc.stop()


def format_fairness(r: FairnessReport) -> str:
    s = r.summary()
    return (f"interactive TTFT idle    p50 {s['idle_ttft_p50_s']:.3f} s  p90 {s['idle_ttft_p90_s']:.3f} s\n"
            f"interactive TTFT loaded  p50 {s['loaded_ttft_p50_s']:.3f} s  p90 {s['loaded_ttft_p90_s']:.3f} s\n"
            f"p90 loaded / idle        {s['p90_ratio']:.2f}x\n"
            f"batch requests finished while measuring: {s['job_finished_meanwhile']}")
