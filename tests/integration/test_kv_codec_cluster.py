"""A link that names a KV codec, on real processes with the plumbing model (its heads
are 64 wide, as SmolLM2's: a codec's bytes per block are the same): Toronto
computes every prompt (it has the only prefill worker) and Montreal decodes
them (the only decode worker), so every prompt's KV crosses the link, which
names int8. Tenant lab-a takes what the link names; lab-b forbids lossy
codecs (``kv_lossy: false``). Each answer's placement says which codec its KV
crossed with and how many bytes; the first token (sampled at the prefill
worker, before the codec) is the same for both tenants, and the rest may
differ as much as `kvrelay bench kv-codec` measured (benchmarks/RESULTS.md)."""

from __future__ import annotations

import secrets

import pytest

from kvrelay.router.core.auth import token_sha256
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import running_cluster, wait_until, workers

pytestmark = pytest.mark.model

TOKENS = {"lab-a": secrets.token_urlsafe(24), "lab-b": secrets.token_urlsafe(24)}
PROMPTS = [
    "Summarise in one sentence why the sky looks blue during the day and red at sunset, for a child.",
    "List three differences between a compiler and an interpreter, then say which one Python uses.",
    "Explain what a hash table is and why looking up a key in one takes about the same time at any size.",
]


def config(kv_codec: str = "int8", gbps: float = 10, kv: dict | None = None) -> dict:
    """Toronto computes every prompt, Montreal decodes it, over one link of ``kv_codec``; tenant lab-a takes
    what the link names, lab-b forbids lossy codecs."""
    return {
        # round_robin: every prompt of colocate_below_tokens or more goes to the prefill worker
        "router": {"port": 0, "placement": {"policy": "round_robin", "colocate_below_tokens": 1},
                   "liveness": {"heartbeat_interval_s": 0.25}},
        "sites": [{"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 0}},
                  {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0},
                   "decode": {"replicas": 1}}],
        "links": [{"between": ["toronto", "montreal"], "rtt_ms": 5, "gbps": gbps, "kv_codec": kv_codec}],
        "kv": kv or {},
        "tenants": [{"name": "lab-a", "token_sha256": token_sha256(TOKENS["lab-a"])},
                    {"name": "lab-b", "token_sha256": token_sha256(TOKENS["lab-b"]), "kv_lossy": False}],
        "workers": {"threads": 1},
        "cache": {"memory_gib": 0.25},
    }


def _generate(lc, tenant: str, prompt: str) -> tuple[list[int], ipb.Placement]:
    req = ipb.GenerateRequest(prompt=prompt, max_tokens=16, ignore_eos=True)
    with lc.dialer(TOKENS[tenant]).sync(lc.router_address) as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=180))
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish.placement


def test_a_link_codec_carries_lossy_tenants_kv_coded_and_never_a_strict_tenants(plumbing_model):
    with running_cluster(config(), plumbing_model) as lc:
        assert wait_until(lambda: sum(w.healthy for w in workers(lc).values()) == 2, 90)
        same = 0
        for prompt in PROMPTS:
            coded, p_a = _generate(lc, "lab-a", prompt)
            plain, p_b = _generate(lc, "lab-b", prompt)
            for p in (p_a, p_b):
                assert (p.prefill_site, p.decode_site, p.link) == ("toronto", "montreal", "montreal-toronto"), p
            assert (p_a.kv_codec, p_b.kv_codec) == ("int8", "none")
            # the same prompt (each tenant's own prefix cache: nothing cached for the other): int8 is 1.94x
            # smaller than the float32 cache's bytes / 2, i.e. 3.88x; at least 3.5x whatever the block count
            assert p_b.kv_bytes >= 3.5 * p_a.kv_bytes > 0, (p_a.kv_bytes, p_b.kv_bytes)
            assert len(coded) == len(plain) == 16
            assert coded[0] == plain[0]  # sampled at the prefill worker, before any codec
            same += coded == plain
        print(f"greedy 16-token answers identical under int8: {same} of {len(PROMPTS)}")
