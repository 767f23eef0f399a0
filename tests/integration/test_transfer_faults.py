"""A worker killed while KV is moving: the surviving side frees its blocks
promptly (checked from its own counters) and keeps serving; the router
recovers the request where another worker can take it."""

from __future__ import annotations

import copy
import signal
import threading
import time

import grpc
import pytest

from cluster.config import parse_config
from cluster.launch_local import LocalCluster
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.conftest import CLUSTER_YAML, wait_until, worker_stats

pytestmark = pytest.mark.model

LONG_PROMPT = "Describe the history of research networks in detail. " * 220  # ~2,400 tokens


def _start(smollm_path) -> LocalCluster:
    raw = copy.deepcopy(CLUSTER_YAML)
    raw["scheduler"] = {"max_num_batched_tokens": 256}  # many prefill chunks: a long transfer window
    raw["router"]["kv_lease_s"] = 60.0
    lc = LocalCluster(parse_config(raw), smollm_path, reconcile=False)  # killed workers stay dead
    lc.start()
    return lc


def _send_in_background(lc: LocalCluster) -> dict:
    out: dict = {}

    def run() -> None:
        with grpc.insecure_channel(lc.router_address) as ch:
            req = ipb.GenerateRequest(prompt=LONG_PROMPT, raw_prompt=True, max_tokens=8)
            try:
                out["msgs"] = list(igrpc.InferenceStub(ch).Generate(req, timeout=120))
            except grpc.RpcError as exc:
                out["error"] = exc.code()
                out["details"] = exc.details()

    t = threading.Thread(target=run)
    t.start()
    out["thread"] = t
    return out


def _kill(lc: LocalCluster, name: str) -> None:
    child = next(c for c in lc.children if c.name == name)
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(10)
    lc.children.remove(child)


def _mid_transfer(lc: LocalCluster) -> bool:
    s = worker_stats(lc, "local/decode/0")
    return s.reservations == 1 and s.kv_bytes_received > 0


def _all_free(lc: LocalCluster, wid: str) -> bool:
    s = worker_stats(lc, wid)
    return s.free_blocks == s.total_blocks and s.reservations == 0 and s.running == 0


def test_prefill_killed_mid_transfer_request_recomputed_at_decode(smollm_path):
    lc = _start(smollm_path)
    try:
        req = _send_in_background(lc)
        assert wait_until(lambda: _mid_transfer(lc), 60, 0.05)
        _kill(lc, "local/prefill/0")
        req["thread"].join(120)
        # D dropped the reservation, the router placed the prompt again: with the only
        # prefill worker gone, D computed it itself; the client saw one whole stream
        assert "msgs" in req, req.get("details")
        fin = req["msgs"][-1].finish
        assert fin.usage.completion_tokens == 8 == sum(len(m.token_ids) for m in req["msgs"])
        assert fin.placement.retries == 1 and fin.placement.colocated
        assert fin.placement.decode_worker == "local/decode/0"
        assert wait_until(lambda: _all_free(lc, "local/decode/0"), 10)
    finally:
        lc.stop()


def test_decode_killed_mid_transfer_prefill_frees_blocks(smollm_path):
    lc = _start(smollm_path)
    try:
        req = _send_in_background(lc)
        assert wait_until(lambda: _mid_transfer(lc), 60, 0.05)
        _kill(lc, "local/decode/0")
        t0 = time.monotonic()
        assert wait_until(lambda: _all_free(lc, "local/prefill/0"), 30)
        assert time.monotonic() - t0 < 30
        req["thread"].join(60)
        # no other decode worker exists: the request fails, saying why
        assert req.get("error") == grpc.StatusCode.UNAVAILABLE, req
        assert "decode" in req["details"]
    finally:
        lc.stop()
