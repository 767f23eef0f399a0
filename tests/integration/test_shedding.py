"""Early shedding on real processes (router.admission.shed_early): one decode worker with two slots,
both taken by long streams and three more waiting. Once the router has seen how fast its queue moves,
a request whose deadline would pass before its turn is refused at once with a retry hint (not left
to wait toward its deadline), while one that can wait is queued and served; every long stream ends
whole."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from kvrelay.router.core.auth import token_sha256
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import running_cluster, wait_until, workers

pytestmark = pytest.mark.model

TOKEN = "token-of-the-shedding-tenant-0123"
LONG = 1300
"""Output tokens of each long stream: the refusal's margin is one stream's length against the 2 s
deadline (about 8 s here at ~6.5 ms a token through the cluster, ~4 s estimated on the fastest host measured)."""


@pytest.fixture(scope="module")
def busy_cluster(plumbing_model):
    raw = {"router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
                      "liveness": {"heartbeat_interval_s": 0.25},
                      "admission": {"max_inflight_per_worker": 2, "interactive_reserve": 0,
                                    "admission_wait_s": 300.0}},
           "sites": [{"name": "montreal", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}],
           "workers": {"threads": 1},
           "cache": {"memory_gib": 0.25},
           "tenants": [{"name": "lab", "token_sha256": token_sha256(TOKEN)}]}
    with running_cluster(raw, plumbing_model, reconcile=False) as lc:
        assert wait_until(lambda: len(workers(lc)) == 2, 60)
        yield lc


def generate(lc, max_tokens: int, timeout: float, first: int = 300) -> ipb.Finish:
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=list(range(first, first + 20))), max_tokens=max_tokens,
                              ignore_eos=True)
    with lc.dialer(TOKEN).sync(lc.router_address) as ch:
        return list(igrpc.InferenceStub(ch).Generate(req, timeout=timeout))[-1].finish


def test_a_request_whose_turn_would_come_after_its_deadline_is_refused_at_once(busy_cluster):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        running = [pool.submit(generate, busy_cluster, LONG, 600.0, 300 + 40 * i) for i in range(2)]
        time.sleep(0.5)  # both slots taken (the next ones wait)
        waiting = [pool.submit(generate, busy_cluster, LONG, 600.0, 500 + 40 * i) for i in range(3)]
        for f in running:
            assert f.result(timeout=600).usage.completion_tokens == LONG
        time.sleep(0.5)  # their slots are given back (before the clients read their ends) ...
        assert wait_until(lambda: workers(busy_cluster)["montreal/decode/0"].inflight == 2, 60)  # ... and retaken
        # two waiting requests were just served: the router has measured its queue (about one per 3 s)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(busy_cluster, 4, timeout=2.0, first=900)  # behind one waiting ticket and two full slots
        took = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()  # not DEADLINE_EXCEEDED
        assert "its turn would come in about" in err.value.details() and "retry in" in err.value.details()
        patient = pool.submit(generate, busy_cluster, 4, 600.0, 950)  # can wait its turn: queued and served
        assert patient.result(timeout=600).usage.completion_tokens == 4
        for f in waiting:
            assert f.result(timeout=600).usage.completion_tokens == LONG  # nothing lost
    print(f"refused after {took:.2f} s")
