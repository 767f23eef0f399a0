"""``links[].kv_codec: auto`` on real processes: each request's codec is chosen
when its placement is known (router/placement/codec_choice.py), from the
link's configured rate and the prefill worker's measured throughput. Toronto
computes every prompt and Montreal decodes it over a link configured at
20 Mbit/s: a long prompt's KV would show (none), so it crosses coded; a
one-block prompt's would not, so it crosses as it is; a tenant that forbids
lossy codecs never gets one. (The rate is the config's here: this loopback
"link" would measure at Gbit/s. A link that measures slow on an emulated
WAN: tests/integration/test_cities_codec.py.)"""

from __future__ import annotations

import random

import pytest

from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from tests.integration.helpers import running_cluster, wait_until, workers
from tests.integration.test_kv_codec_cluster import TOKENS
from tests.integration.test_kv_codec_cluster import config as codec_config

pytestmark = pytest.mark.model


def config() -> dict:
    raw = codec_config("auto", gbps=0.02, kv={"auto_codecs": ["none", "int8", "int4"]})
    raw["router"]["placement"]["link_rates"] = {"measure": False}  # loopback would measure Gbit/s
    return raw


def _generate(lc, tenant: str, n: int, seed: int) -> ipb.Placement:
    rng = random.Random(seed)
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[rng.randrange(100, 40000) for _ in range(n)]),
                              max_tokens=2, ignore_eos=True)
    with lc.dialer(TOKENS[tenant]).sync(lc.router_address) as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(req, timeout=120))
    assert sum(len(m.token_ids) for m in msgs) == 2
    return msgs[-1].finish.placement


def test_auto_codes_what_the_link_would_show_and_nothing_else(plumbing_model):
    with running_cluster(config(), plumbing_model) as lc:
        assert wait_until(lambda: sum(w.healthy for w in workers(lc).values()) == 2, 60)
        _generate(lc, "lab-a", 2000, 0)  # the prefill worker measures its throughput
        # 3000 tokens: 6 MB of fp32 KV, 2.5 s at 20 Mbit/s against well under a second of prefill
        long_a, long_b = _generate(lc, "lab-a", 3000, 1), _generate(lc, "lab-b", 3000, 1)
        short = _generate(lc, "lab-a", 10, 2)  # one block: 13 ms uncoded, not worth a lossy codec
        for p in (long_a, long_b, short):
            assert p.link == "montreal-toronto" and not p.colocated, p
        assert long_a.kv_codec in ("int8", "int4"), long_a
        assert (long_b.kv_codec, short.kv_codec) == ("none", "none")
        assert long_b.kv_bytes > 3.5 * long_a.kv_bytes  # fp32 KV: int8 3.88x fewer bytes, int4 7.1x
        with lc.channel(operator=True) as ch:  # what `kvrelay status` shows
            links = {lk.name: lk for lk in wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(),
                                                                             timeout=10).links}
        assert (links["montreal-toronto"].kv_codec, links["local"].kv_codec) == ("auto", "none")
