"""Trace loading, prompt building and metrics of `kvrelay bench replay`,
on slices of the real public traces (benchmarks/data, the first 200
requests of each) and on constructed records."""

from __future__ import annotations

import json

import pytest

from kvrelay.benchmarks.metrics import RequestRecord, distribution, summarize
from kvrelay.benchmarks.replay import _spread, check_lengths
from kvrelay.benchmarks.traces import (
    SAMPLE_AZURE,
    SAMPLE_MOONCAKE,
    TraceError,
    build_prompts,
    detect_format,
    load_trace,
)

AZURE, MOONCAKE = SAMPLE_AZURE, SAMPLE_MOONCAKE


def test_real_traces_load_with_relative_arrivals():
    az = load_trace(AZURE, limit=50)
    assert detect_format(AZURE) == "azure" and len(az) == 50
    assert az[0].arrival_s == 0 and az[1].arrival_s == pytest.approx(0.052, abs=1e-6)  # 03.97996 -> 04.03196
    assert (az[0].input_tokens, az[0].output_tokens) == (4808, 10)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(az, az[1:]))
    mc = load_trace(MOONCAKE, limit=20)
    assert detect_format(MOONCAKE) == "mooncake"
    assert (mc[0].input_tokens, mc[0].output_tokens, mc[2].arrival_s) == (40160, 6, 0.04)
    assert len(mc[0].hash_ids) == -(-40160 // 512)


@pytest.mark.parametrize("content,match", [
    ('{"timestamp": 0, "input_length": 10}\n', "missing output_length"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 2}\n', "timestamp must be"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 2}\n', "input_length must be >= 1"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}\n', "1 hash_ids for 600"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2}\n{oops\n', r":2: not JSON"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", r":2: TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,x,5\n", "ContextTokens must be an integer"),
    ("hello\n", "cannot tell the trace format"),
])
def test_malformed_traces_name_the_line(tmp_path, content, match):
    f = tmp_path / "t.trace"
    f.write_text(content)
    with pytest.raises(TraceError, match=match):
        load_trace(f)


def test_prompts_have_exact_lengths_and_share_blocks_where_hash_ids_repeat():
    reqs = load_trace(MOONCAKE, limit=200)
    shared = next((a, b) for i, a in enumerate(reqs) for b in reqs[i + 1:] if a.hash_ids[:2] == b.hash_ids[:2])
    scale = 0.05
    prompts = {p.trace.index: p for p in build_prompts(reqs, scale, (100, 10000))}
    block = round(512 * scale)
    for r in reqs:
        p = prompts[r.index]
        assert len(p.prompt) == max(1, round(r.input_tokens * scale))
        assert p.max_tokens == max(1, round(r.output_tokens * scale))
    a, b = prompts[shared[0].index].prompt, prompts[shared[1].index].prompt
    assert a[:2 * block] == b[:2 * block]
    other = next(r for r in reqs if not set(r.hash_ids) & set(shared[0].hash_ids))
    assert prompts[other.index].prompt[:block] != a[:block]
    assert check_lengths(reqs, 1.0, 8192) and not check_lengths(reqs[:3], 0.01, 8192)


def rec(i, sent, times, end=None, error=None, n_in=100):
    last = end if end is not None or not times else times[-1]
    return RequestRecord(i, sent, sent, n_in, len(times), list(times), last, error)


def test_metrics_follow_the_fields_definitions():
    records = [rec(0, 0.0, [0.5, 0.6, 0.7, 0.8]),  # TTFT 0.5, TPOT 0.1, ITL 0.1 x3
               rec(1, 1.0, [1.2, 1.6]),  # TTFT 0.2, TPOT 0.4
               rec(2, 2.0, [], error="UNAVAILABLE: no worker")]
    s = summarize(records, slo_ttft_s=0.3, slo_tpot_s=0.5)
    assert s["completed"] == 2 and s["failed"] == 1 and s["failures"] == {"UNAVAILABLE: no worker": 1}
    assert s["ttft_ms"]["mean"] == pytest.approx(350) and s["tpot_ms"]["p50"] == pytest.approx(250)
    assert s["itl_ms"]["count"] == 4 and s["e2e_ms"]["mean"] == pytest.approx((800 + 600) / 2)
    assert s["duration_s"] == pytest.approx(1.6)
    assert s["request_throughput_rps"] == pytest.approx(2 / 1.6)
    assert s["output_token_throughput_tps"] == pytest.approx(6 / 1.6)
    # only request 1 meets TTFT <= 0.3 s and TPOT <= 0.5 s; the failed one counts as a miss
    assert s["goodput_rps"] == pytest.approx(1 / 1.6) and s["slo_attainment"] == pytest.approx(1 / 3)
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert (d["p50"], d["p90"]) == (pytest.approx(2.5), pytest.approx(3.7))
    json.dumps(s)


def test_tokens_of_one_message_are_spread_over_its_gap():
    t = [1.0, 2.0, 2.0, 2.0, 3.0]
    _spread(t)
    assert t == pytest.approx([1.0, 1 + 1 / 3, 1 + 2 / 3, 2.0, 3.0])
