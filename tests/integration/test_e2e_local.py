"""End to end with the local (shared-memory) KV transport: same tokens as the
engine alone, and the prefill's shared KV file is gone after shutdown."""

from __future__ import annotations

import copy
from pathlib import Path

import grpc
import pytest

from cluster.config import parse_config
from cluster.launch_local import LocalCluster
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.conftest import CLUSTER_YAML, workers
from tests.integration.test_e2e import PROMPTS, chat_request, collect, reference

pytestmark = pytest.mark.model


def test_local_transport_end_to_end(smollm_path, reference_engine):
    raw = copy.deepcopy(CLUSTER_YAML)
    raw["kv"] = {"transport": "local"}
    lc = LocalCluster(parse_config(raw), smollm_path)
    lc.start()
    try:
        ws = workers(lc)
        assert ws["local/prefill/0"].info.transport == "local"
        pid = next(c.proc.pid for c in lc.children if c.name == "local/prefill/0")
        assert list(Path("/dev/shm").glob(f"kvrelay-*-{pid}"))
        with grpc.insecure_channel(lc.router_address) as ch:
            stub = igrpc.InferenceStub(ch)
            for text in PROMPTS[:4]:
                tokens, msgs = collect(stub, chat_request(text))
                assert tokens == reference(reference_engine, text), text
                assert msgs[-1].finish.placement.transport == "local"
                assert msgs[-1].finish.placement.kv_bytes > 0
    finally:
        lc.stop()
    assert not list(Path("/dev/shm").glob(f"kvrelay-*-{pid}"))
