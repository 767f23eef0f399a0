"""`kvrelay bench cities --codecs`: its deployments and its long-prompt slice."""

from __future__ import annotations

import argparse

import pytest

from kvrelay.benchmarks import cities_bench as cb
from kvrelay.benchmarks.traces import TraceRequest
from kvrelay.cli.local import _codec_flags
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.topology import Topology


def test_one_valid_deployment_per_codec_over_one_shaped_link():
    scenarios = cb.codec_scenarios(cb.load_example(), mbps=200, rtt_ms=30)
    assert [s.name for s in scenarios] == ["codec-none", "codec-int8", "codec-fp8", "codec-int4", "codec-auto"]
    for sc, codec in zip(scenarios, cb.CODECS):
        cfg = parse_config(sc.config)
        topo = Topology(cfg)
        link = topo.link("toronto", "vancouver")
        assert link is not None and (link.gbps, link.rtt_ms, topo.codec(link)) == (0.2, 30, codec)
        assert [(s.name, s.prefill.replicas, s.decode.replicas) for s in cfg.sites] == \
            [("toronto", 1, 0), ("vancouver", 0, 1)]
        assert cfg.router.placement.colocate_below_tokens == 0  # every prompt crosses the link
        assert topo.auto_codecs() == ["none", "int8", "int4"]


def test_the_long_slice_keeps_prompts_in_range_and_spaces_them():
    reqs = [TraceRequest(i, i * 0.1, n, 2) for i, n in enumerate([100, 2500, 9000, 3000, 2000, 4100])]
    picked = cb.long_slice(reqs, 1.0, 2000, 4000, limit=2, gap_s=15)
    assert [(r.index, r.arrival_s) for r in picked] == [(1, 0.0), (3, 15.0)]
    assert [r.index for r in cb.long_slice(reqs, 2.0, 4000, 8000, limit=9, gap_s=1)] == [1, 3, 4]


def _args(codecs: bool, **given) -> argparse.Namespace:
    flags = {"link_mbps": None, "link_rtt_ms": None, "prompt_tokens": None, "gap_s": None}
    return argparse.Namespace(codecs=codecs, **(flags | given))


def test_the_codec_flags_are_refused_without_codecs_and_checked_with_it():
    with pytest.raises(ValueError, match=r"--link-mbps, --gap-s: only with --codecs"):
        _codec_flags(_args(False, link_mbps=50.0, gap_s=3.0))
    assert _codec_flags(_args(False)) is None
    args = _args(True, prompt_tokens="2500")
    assert _codec_flags(args) == (2500, 2500) and (args.link_mbps, args.gap_s) == (200.0, 20.0)
    for bad in ("abc", "3000-2000", "0-10", "-5"):
        with pytest.raises(ValueError, match="--prompt-tokens"):
            _codec_flags(_args(True, prompt_tokens=bad))
    with pytest.raises(ValueError, match="--link-mbps must be positive"):
        _codec_flags(_args(True, link_mbps=0.0))
