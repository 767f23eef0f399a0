"""The pool-size planner's rules, on constructed figures."""

from __future__ import annotations

from kvrelay.router.cluster.planner import PoolFigures, plan, plan_decode, plan_prefill

SLO_TTFT, SLO_TPOT = 2.0, 0.2


def prefill(**kw) -> PoolFigures:
    base = dict(site="toronto", role="prefill", desired=2, active=2, min_replicas=0, max_replicas=4,
                tokens_per_s_per_worker=1000.0)
    return PoolFigures(**{**base, **kw})


def decode(**kw) -> PoolFigures:
    base = dict(site="montreal", role="decode", desired=2, active=2, min_replicas=0, max_replicas=4)
    return PoolFigures(**{**base, **kw})


def test_prefill_grows_when_ttft_misses_the_slo():
    p = plan_prefill(prefill(ttft_p90_s=3.5, tokens_per_s_placed=900), SLO_TTFT)
    assert p.recommended == 3 and "TTFT p90 3.50 s > SLO 2 s" in p.reasons[0]


def test_prefill_sized_by_placed_tokens_and_capped():
    # 5,000 tok/s at 70% of 1,000 tok/s per worker needs 8 workers: capped at 4
    p = plan_prefill(prefill(ttft_p90_s=9.0, tokens_per_s_placed=5000), SLO_TTFT)
    assert p.recommended == 4 and any("max_replicas=4" in r for r in p.reasons)


def test_prefill_grows_on_queued_work_before_ttft_is_measured():
    p = plan_prefill(prefill(queued_tokens=10_000), SLO_TTFT)  # 10k tokens / 2k tok/s = 5 s of work
    assert p.recommended == 3 and "queued" in p.reasons[0]


def test_prefill_shrinks_by_one_when_idle_and_fast():
    p = plan_prefill(prefill(desired=3, active=3, ttft_p90_s=0.3, tokens_per_s_placed=100), SLO_TTFT)
    assert p.recommended == 2


def test_prefill_keeps_its_size_within_targets_and_respects_min():
    assert plan_prefill(prefill(ttft_p90_s=1.5, tokens_per_s_placed=1000), SLO_TTFT).recommended == 2
    p = plan_prefill(prefill(desired=1, active=1, min_replicas=1, ttft_p90_s=0.1), SLO_TTFT)
    assert p.recommended == 1


def test_decode_rules():
    assert plan_decode(decode(tpot_p90_s=0.5), SLO_TPOT).recommended == 3
    assert plan_decode(decode(waiting=4, tpot_p90_s=0.05), SLO_TPOT).recommended == 3
    assert plan_decode(decode(kv_usage=0.9), SLO_TPOT).recommended == 3
    assert plan_decode(decode(kv_usage=0.1, tpot_p90_s=0.05), SLO_TPOT).recommended == 1
    assert plan_decode(decode(kv_usage=0.5, tpot_p90_s=0.05), SLO_TPOT).recommended == 2
    # a site's last decode worker is never removed by the planner
    assert plan_decode(decode(desired=1, active=1, kv_usage=0.0), SLO_TPOT).recommended == 1


def test_cluster_keeps_a_decode_worker():
    plans = plan([decode(desired=0, active=0, kv_usage=0.0), prefill(desired=1, active=1)], SLO_TTFT, SLO_TPOT)
    assert [p.recommended for p in plans if p.role == "decode"] == [1]
