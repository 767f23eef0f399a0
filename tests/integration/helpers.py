"""What the integration tests share besides fixtures: the default cluster's
config, starting a cluster, asking the registry and the workers, the
requests and reference outputs of the end-to-end tests, and waiting."""

from __future__ import annotations

import contextlib
import json
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import grpc

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.launch.local import LocalCluster
from kvrelay.router.core.disk import DiskReserve
from kvrelay.router.core.quotas import Quotas
from kvrelay.router.core.tenancy import TenantPolicies
from kvrelay.router.frontends.jobs import JobService, add_jobs_to_server
from kvrelay.runtime.config import RecordsSection, parse_config
from kvrelay.runtime.rpc import PLAINTEXT, bind, create_server
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

CLUSTER_YAML = {
    # least_loaded, never colocated: these tests exercise the prefill -> decode
    # path; placement has its own tests (test_multisite.py, unit/test_placement.py)
    "router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0}},
    "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
}


class JobGates:
    """What SubmitJob asks of the router core before it checks a job, for stand-ins of the core:
    the tenants' policies (every caller a bare tenant), their quotas, and a disk with no stores."""

    def __init__(self) -> None:
        self.tenants = TenantPolicies(parse_config({"sites": [
            {"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}]}))
        self.quotas = Quotas()
        self.disk = DiskReserve({}, RecordsSection())

    def door(self, tenant: str, api: str) -> None:
        """One router: every tenant's prompts may enter (the core's rule with several: test_routers.py)."""

    def barred_here(self) -> frozenset[str]:
        """One router: no tenant is barred."""
        return frozenset()


@contextlib.contextmanager
def running_cluster(raw: dict, model_path, **kw):
    """A started LocalCluster of config ``raw`` (keywords go to LocalCluster), stopped afterwards."""
    lc = LocalCluster(parse_config(raw), model_path, **kw)
    lc.start()
    try:
        yield lc
    finally:
        lc.stop()


def workers(cluster) -> dict[str, wpb.WorkerStatus]:
    with cluster.channel(operator=True) as ch:
        resp = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)
    return {w.info.worker_id: w for w in resp.workers}


def worker_stats(cluster, worker_id: str) -> wpb.WorkerLoad:
    """Asks the worker itself (not the router's cached heartbeat)."""
    info = workers(cluster)[worker_id].info
    with cluster.worker_channel(info) as ch:
        stub = (wgrpc.DecodeWorkerStub(ch) if info.role == wpb.ROLE_DECODE else wgrpc.PrefillWorkerStub(ch))
        return stub.Stats(wpb.StatsRequest(), timeout=10)


def cluster_user(cluster, monkeypatch) -> list[str]:
    """CLI flags (and environment) that reach ``cluster`` as its local tenant
    and its operator: the router, its CA, the tokens."""
    monkeypatch.setenv("KVRELAY_API_KEY", cluster.client_token)
    monkeypatch.setenv("KVRELAY_OPERATOR_TOKEN", cluster.operator_token)
    return ["--router", cluster.router_address, "--ca", str(cluster.ca_file)]


def tls_context(cluster) -> ssl.SSLContext:
    """What an HTTPS client of ``cluster`` verifies the router by: its CA."""
    return ssl.create_default_context(cafile=str(cluster.ca_file))


def wait_until(pred, timeout_s: float = 10.0, interval_s: float = 0.1) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours.",
           "What does a network router do?", "Explain photosynthesis in one sentence.",
           "What is 17 plus 25?", "Give a synonym for 'happy'.", "Who wrote Hamlet?"]


def chat_request(text: str, max_tokens: int = 24, **kw) -> ipb.GenerateRequest:
    req = ipb.GenerateRequest(messages=ipb.ChatMessages(messages=[ipb.ChatMessage(role="user", content=text)]),
                              max_tokens=max_tokens, **kw)
    return req


def collect(stub, req, timeout=120):
    msgs = list(stub.Generate(req, timeout=timeout))
    return [t for m in msgs for t in m.token_ids], msgs


_REFERENCES: dict[tuple[str, str, int], list[int]] = {}
"""Greedy outputs already computed, by (model folder, text, max_tokens): greedy decoding is deterministic."""


def warm_references(engine, texts, max_tokens=24) -> None:
    """Computes the references of ``texts`` not computed yet in one batch (what :func:`reference` then returns)."""
    todo = [t for t in dict.fromkeys(texts) if (str(engine.cfg.model_path), t, max_tokens) not in _REFERENCES]
    if not todo:
        return
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in todo]
    for text, out in zip(todo, engine.generate(prompts, SamplingParams(max_tokens=max_tokens))):
        _REFERENCES[(str(engine.cfg.model_path), text, max_tokens)] = list(out.token_ids)


def reference(engine, text, max_tokens=24):
    """The engine's greedy output for ``text`` as a chat (computed once per model, text and length)."""
    key = (str(engine.cfg.model_path), text, max_tokens)
    if key not in _REFERENCES:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
        _REFERENCES[key] = list(engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0].token_ids)
    return list(_REFERENCES[key])


def stream_killing_its_decode_worker(cluster, req: ipb.GenerateRequest, after_tokens: int = 8,
                                     timeout: float = 180) -> tuple[list[int], list, str | None]:
    """Streams ``req``; once ``after_tokens`` arrived, SIGKILLs the one decode worker serving it.
    (tokens, messages, the killed worker's id; None if the stream ended first)."""
    tokens: list[int] = []
    msgs: list = []
    killed = None
    with cluster.channel() as ch:
        for msg in igrpc.InferenceStub(ch).Generate(req, timeout=timeout):
            msgs.append(msg)
            tokens += msg.token_ids
            if killed is None and len(tokens) >= after_tokens:
                busy = [w for w, s in workers(cluster).items() if s.info.role == wpb.ROLE_DECODE and s.inflight > 0]
                assert len(busy) == 1, busy
                killed = busy[0]
                child = next(c for c in cluster.children if c.name == killed)
                child.proc.send_signal(signal.SIGKILL)
                child.proc.wait(10)
    return tokens, msgs, killed


@contextlib.asynccontextmanager
async def jobs_server(svc: JobService) -> AsyncIterator[grpc.aio.Channel]:
    """``svc``'s Jobs API on a free loopback port (plaintext) and a channel to it; the server stops after."""
    server = create_server()
    add_jobs_to_server(svc, server)
    port = bind(server, "127.0.0.1", 0, None)
    await server.start()
    try:
        async with PLAINTEXT.aio(f"127.0.0.1:{port}") as ch:
            yield ch
    finally:
        await server.stop(None)


_ALONE = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
import vllm
from vllm.inputs import TokensPrompt
args = json.loads(sys.argv[1])
llm = vllm.LLM(model=args["model"], dtype=args["dtype"], enforce_eager=True, max_model_len=2048,
               kv_cache_memory_bytes=1 << 28, seed=0)
sps = [vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in args["max_tokens"]]
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in args["prompts"]], sps, use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def vllm_alone(model, prompts: list[list[int]], max_tokens: list[int], dtype: str = "float32") -> list[list[int]]:
    """Greedy outputs of vLLM alone (its offline engine, in a child process: one engine per process)
    for ``prompts``, each its ``max_tokens`` (EOS ignored: the vLLM pool tests set ignore_eos)."""
    arg = json.dumps({"model": str(model), "prompts": prompts, "max_tokens": max_tokens, "dtype": dtype})
    proc = subprocess.run([sys.executable, "-c", _ALONE, arg], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))
