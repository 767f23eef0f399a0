"""Two sites in one config, on this machine: Toronto (CA-ON) and Montreal
(CA-QC), each with a prefill and a decode worker, joined by a link.
Residency is checked from the workers' own counters, prefix-cache hits
from the workers' own prefix-cache statistics."""

from __future__ import annotations

import random

import grpc
import pytest

from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import wait_until, worker_stats, workers

pytestmark = pytest.mark.model

SITES = {"toronto": "CA-ON", "montreal": "CA-QC"}
WORKERS = [f"{s}/{r}/0" for s in SITES for r in ("prefill", "decode")]


def two_sites(policy: str) -> dict:
    return {
        "router": {"port": 0, "placement": {"policy": policy}, "liveness": {"heartbeat_interval_s": 0.25}},
        "sites": [{"name": s, "jurisdiction": j, "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
                  for s, j in SITES.items()],
        "links": [{"between": ["toronto", "montreal"], "rtt_ms": 9, "gbps": 10}],
        "workers": {"threads": 1},
        "cache": {"memory_gib": 0.25},
    }


def start(policy: str, plumbing_model) -> LocalCluster:
    lc = LocalCluster(parse_config(two_sites(policy)), plumbing_model)
    lc.start()
    assert wait_until(lambda: len(workers(lc)) == 4, 60)
    return lc


@pytest.fixture(scope="module")
def multisite(plumbing_model):
    lc = start("cost_model", plumbing_model)
    yield lc
    lc.stop()


def token_request(ids: list[int], **kw) -> ipb.GenerateRequest:
    return ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=2, ignore_eos=True, **kw)


def generate(lc: LocalCluster, req: ipb.GenerateRequest) -> ipb.Finish:
    with lc.channel() as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=120))
    return msgs[-1].finish


def counters(lc: LocalCluster) -> dict[str, tuple[int, int, int, int]]:
    """Per worker, from the worker itself: prompt tokens computed, tokens
    decoded, prefix-cache hit blocks and lookup blocks."""
    out = {}
    for wid in WORKERS:
        s = worker_stats(lc, wid)
        out[wid] = (s.prefill_tokens_total, s.decode_tokens_total, s.prefix_hit_blocks, s.prefix_query_blocks)
    return out


def test_restricted_request_is_served_only_in_its_jurisdiction(multisite):
    rng = random.Random(1)
    before = counters(multisite)
    for n in (40, 300, 700):  # short (colocated) to long (disaggregated) prompts
        fin = generate(multisite, token_request([rng.randrange(100, 40000) for _ in range(n)],
                                                allowed_jurisdictions=["CA-QC"]))
        assert fin.placement.decode_site == fin.placement.prefill_site == "montreal"
        assert fin.placement.policy == "cost_model" and fin.placement.estimated_ttft_ms > 0
    after = counters(multisite)
    for wid in WORKERS:
        moved = [a - b for a, b in zip(after[wid][:2], before[wid][:2])]
        if wid.startswith("toronto"):
            assert moved == [0, 0], f"{wid} computed for a CA-QC-only request"
    assert sum(after[w][0] - before[w][0] for w in WORKERS if w.startswith("montreal")) >= 40 + 300 + 700 - 3
    assert after["montreal/decode/0"][1] > before["montreal/decode/0"][1]


def test_unsatisfiable_jurisdiction_fails_with_failed_precondition(multisite):
    with multisite.channel() as ch, pytest.raises(grpc.RpcError) as err:
        list(igrpc.InferenceStub(ch).Generate(token_request(list(range(100, 200)),
                                                            allowed_jurisdictions=["EU"]), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "EU" in err.value.details()


def test_unreachable_deadline_is_refused_with_a_retry_hint(multisite):
    with multisite.channel() as ch:
        call = igrpc.InferenceStub(ch).Generate(token_request(list(range(100, 1900))), timeout=0.05)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert dict(err.value.trailing_metadata())["retry-after-ms"].isdigit()


def cached_blocks(lc: LocalCluster) -> dict[str, int]:
    """Prompt blocks the router's prefix index holds, per worker."""
    return {wid: w.cached_blocks for wid, w in workers(lc).items()}


def settled(lc: LocalCluster) -> bool:
    """The router's view of every worker is idle: nothing in flight, running, queued or reserved."""
    return all(w.inflight == 0 and w.load.running == 0 and w.load.waiting == 0 and w.load.reservations == 0
               and w.load.queued_prefill_tokens == 0 for w in workers(lc).values())


def hit_rate(lc: LocalCluster, seed: int) -> float:
    """Four prompt groups, each sent twice in a row: shared 192-token prefix,
    distinct 40-token suffix. Hit rate over every worker's prefix cache."""
    rng = random.Random(seed)
    before = counters(lc)
    for _ in range(4):
        prefix = [rng.randrange(100, 40000) for _ in range(192)]
        known = cached_blocks(lc)
        fin = generate(lc, token_request(prefix + [rng.randrange(100, 40000) for _ in range(40)]))
        served = {fin.placement.prefill_worker, fin.placement.decode_worker} - {""}
        # the prefix index learns of each serving worker's new blocks with that worker's next heartbeat
        # (the decode worker's may come later than the prefill worker's), and the loads the estimate
        # reads settle with the one after the request ends: the second request waits for all of it
        assert wait_until(lambda: all(cached_blocks(lc)[w] > known[w] for w in served)  # noqa: B023 (called before the loop moves on)
                          and settled(lc), 60, 0.05), (served, known, cached_blocks(lc))
        generate(lc, token_request(prefix + [rng.randrange(100, 40000) for _ in range(40)]))
    after = counters(lc)
    hits = sum(after[w][2] - before[w][2] for w in WORKERS)
    queries = sum(after[w][3] - before[w][3] for w in WORKERS)
    return hits / max(1, queries)


def with_policy(lc: LocalCluster, policy: str) -> None:
    """The same workers behind a router restarted with ``policy`` (cheaper than a new cluster)."""
    lc.cfg.router.placement.policy = policy
    lc.restart_router()
    assert wait_until(lambda: sum(w.healthy for w in workers(lc).values()) == 4 and settled(lc), 30)


def test_shared_prefixes_hit_the_cache_under_prefix_aware_and_cost_model_not_round_robin(multisite):
    rates = {"cost_model": hit_rate(multisite, 7)}
    try:
        for policy, seed in (("prefix_aware", 11), ("round_robin", 13)):  # new prefixes for each policy
            with_policy(multisite, policy)
            rates[policy] = hit_rate(multisite, seed)
    finally:
        with_policy(multisite, "cost_model")
    print("prefix-cache hit rate by policy:", {k: round(v, 3) for k, v in rates.items()})
    assert rates["round_robin"] == 0.0, rates
    assert rates["prefix_aware"] >= 0.2 and rates["cost_model"] >= 0.2, rates
