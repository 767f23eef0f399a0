"""End to end with the local (shared-memory) and NIXL KV transports (NIXL on
an integrity link, where the decode worker pulls): the same tokens as the
engine alone (tcp is covered by test_e2e.py); the prefill's shared KV file
is gone after shutdown."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import (
    CLUSTER_YAML,
    PROMPTS,
    chat_request,
    collect,
    reference,
    warm_references,
    workers,
)

pytestmark = pytest.mark.model


@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_transport_end_to_end(transport, plumbing_model, plumbing_reference):
    raw = copy.deepcopy(CLUSTER_YAML)
    # NIXL pulls cross the fabric unencrypted: only an integrity link lets the decode worker pull
    raw["kv"] = {"transport": transport, **({"protection": "integrity"} if transport == "nixl" else {})}
    warm_references(plumbing_reference, PROMPTS[:4])
    lc = LocalCluster(parse_config(raw), plumbing_model)
    lc.start()
    try:
        ws = workers(lc)
        assert ws["local/prefill/0"].info.transport == transport
        pid = next(c.proc.pid for c in lc.children if c.name == "local/prefill/0")
        assert bool(list(Path("/dev/shm").glob(f"kvrelay-*-{pid}"))) == (transport == "local")
        with lc.channel() as ch:
            stub = igrpc.InferenceStub(ch)
            for text in PROMPTS[:4]:
                tokens, msgs = collect(stub, chat_request(text))
                assert tokens == reference(plumbing_reference, text), text
                assert msgs[-1].finish.placement.transport == transport
                assert msgs[-1].finish.placement.kv_bytes > 0
    finally:
        lc.stop()
    assert not list(Path("/dev/shm").glob(f"kvrelay-*-{pid}"))
