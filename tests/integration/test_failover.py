"""A decode worker killed (SIGKILL) mid-stream: the router migrates the
stream to the other decode worker, which prefills the prompt plus the tokens
already sent; the client's greedy output equals the uninterrupted
reference, with no token duplicated or missing."""

from __future__ import annotations

import pytest

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import running_cluster, stream_killing_its_decode_worker, wait_until, workers

pytestmark = pytest.mark.model

CONFIG = {
    "router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
               "liveness": {"heartbeat_interval_s": 0.25}},
    "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 3}}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def failover_cluster(smollm_path):
    with running_cluster(CONFIG, smollm_path, reconcile=False) as lc:  # the killed worker stays dead
        yield lc


def test_decode_worker_killed_mid_stream_is_migrated(failover_cluster, reference_engine):
    """With penalties: the resumed request counts the tokens already sent as output
    (WorkRequest.prior_output_tokens), so the continuation is the uninterrupted one."""
    prompt = reference_engine.tokenizer.encode("The first research networks in Canada connected universities")
    penalties = dict(repetition_penalty=1.125, presence_penalty=0.25, frequency_penalty=0.5)
    want = reference_engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                              **penalties))[0].token_ids
    tokens, msgs, killed = stream_killing_its_decode_worker(failover_cluster, ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, ignore_eos=True,
        sampling=ipb.SamplingParams(**penalties)))
    assert killed is not None
    assert tokens == want  # nothing duplicated, nothing missing, same greedy continuation
    fin = msgs[-1].finish
    assert fin.placement.migrations == 1 and fin.placement.decode_worker != killed
    assert fin.usage.prompt_tokens == len(prompt) and fin.usage.completion_tokens == MAX_TOKENS
    assert wait_until(lambda: not workers(failover_cluster)[killed].healthy, 30)  # worker_timeout_s (5 s), then some


def test_a_decode_worker_whose_engine_dies_leaves_and_is_replaced(plumbing_model, plumbing_reference):
    """The engine thread of local/decode/0 fails at its 4th step (fault injection):
    the worker deregisters and exits non-zero, the launcher starts local/decode/1,
    and the request, waiting for it, finishes with the reference output. (The fault comes at a step,
    not a time: the plumbing model, the cheapest that serves it.)"""
    raw = dict(CONFIG, sites=[dict(CONFIG["sites"][0], decode={"replicas": 1})],
               workers={"threads": 1, "fail_engine_worker": "local/decode/0", "fail_engine_at_step": 4},
               router=dict(CONFIG["router"], admission={"unavailable_wait_s": 120.0}))
    prompt = plumbing_reference.tokenizer.encode("Name three research and education networks")
    want = plumbing_reference.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    with running_cluster(raw, plumbing_model) as lc, lc.channel() as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=prompt), max_tokens=12, ignore_eos=True), timeout=300))
        assert [t for m in msgs for t in m.token_ids] == want
        assert msgs[-1].finish.placement.decode_worker == "local/decode/1"
        assert msgs[-1].finish.placement.migrations == 1  # it failed mid-stream
        gone = [c for c in lc.left if c.name == "local/decode/0"]
        assert gone and gone[0].proc.poll() == 1
        assert "local/decode/0" not in workers(lc)


def test_a_migrated_stream_reuses_the_prompts_kv_the_prefill_worker_still_holds(failover_cluster):
    """Recovery costs what the fault cost: the prefill worker that computed the prompt keeps its blocks in
    its prefix cache, the router's index knows them, and the migrated attempt is placed where they are:
    only the tokens already sent (and the prompt's last partial block) are computed again. (The module's
    cluster has three decode workers: the test above killed one.)"""
    prompt = list(range(2000, 2200))  # 200 tokens: 12 full blocks of 16
    lc = failover_cluster
    assert wait_until(lambda: sum(w.healthy for w in workers(lc).values()) >= 3, 60)
    tokens, msgs, killed = stream_killing_its_decode_worker(lc, ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, ignore_eos=True))
    assert killed is not None and len(tokens) == MAX_TOKENS
    fin = msgs[-1].finish
    assert fin.placement.migrations == 1
    assert fin.placement.prefill_cached_blocks >= len(prompt) // 16, fin.placement  # the prompt's blocks, held
    assert fin.usage.cached_prompt_tokens >= 192, fin.usage  # ... and reused, not computed again
