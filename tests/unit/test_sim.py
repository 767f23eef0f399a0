"""The capacity simulator (benchmarks/sim): its links, its request path
against hand-computed times, failures and recovery, determinism, profiles,
and the capacity planner's minimality."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.benchmarks.sim.clock import Clock
from kvrelay.benchmarks.sim.cluster import Failure, RateChange, SimConfig
from kvrelay.benchmarks.sim.network import SimLink
from kvrelay.benchmarks.sim.planner import PlanGoal, Planner, deployment
from kvrelay.benchmarks.sim.profile import ProfileError, attention_pairs, load_profile
from kvrelay.benchmarks.sim.profiler import Point, fit
from kvrelay.benchmarks.sim.run import Objectives, simulate
from kvrelay.benchmarks.sim.workload import SimArrival, arrivals
from kvrelay.benchmarks.traces import SAMPLE_AZURE, SAMPLE_MOONCAKE, load_trace
from kvrelay.router.placement.place import LinkView
from kvrelay.runtime.config import parse_config

H100 = "h100:llama-3.1-8b"


def one_site(prefill: int, decode: int, policy: str = "least_loaded", admission: dict | None = None) -> dict:
    return {"router": {"placement": {"policy": policy, "colocate_below_tokens": 0}, "admission": admission or {}},
            "sites": [{"name": "a", "prefill": {"replicas": prefill}, "decode": {"replicas": decode}}],
            "local_link": {"rtt_ms": 0.5, "gbps": 100}}


def run(cfg: dict, arr: list[SimArrival], profile=H100, **sim) -> dict:
    return simulate(parse_config(cfg), load_profile(profile) if isinstance(profile, str) else profile, arr,
                    SimConfig(**sim), Objectives(1.0, 0.05), {})


def request(prompt: int, out: int, at: float = 0.0, index: int = 0) -> SimArrival:
    return SimArrival(index, at, prompt, out, [], 512)


# ------------------------------------------------------------------ links
def _link(gbps: float = 8.0, rtt_ms: float = 2.0) -> tuple[Clock, SimLink]:
    clock = Clock()
    return clock, SimLink(clock, LinkView(rtt_ms, gbps, name="x"))


def test_flows_share_a_link_equally_and_arrive_half_an_rtt_later():
    clock, link = _link()  # 1 GB/s
    done = {}
    for name in ("f", "g"):
        flow = link.open(lambda ok, name=name: done.setdefault(name, (clock.now, ok)))
        clock.at(0.0, link.add, flow, 1e8)
        clock.at(0.0, link.close, flow)
    clock.run()
    assert done["f"] == pytest.approx((0.201, True)) and done["g"] == pytest.approx((0.201, True))


def test_bytes_streamed_as_they_are_produced_hide_behind_the_compute():
    clock, link = _link()
    done = {}
    flow = link.open(lambda ok: done.setdefault("t", clock.now))
    for k in range(8):  # 80 MB produced over 0.8 s: the link (1 GB/s) keeps up
        clock.at(0.1 * (k + 1), link.add, flow, 1e7)
    clock.at(0.8, link.close, flow)
    clock.run()
    assert done["t"] == pytest.approx(0.8 + 0.01 + 0.001)  # only the last piece is exposed


def test_a_link_going_down_fails_its_flows():
    clock, link = _link()
    done = {}
    flow = link.open(lambda ok: done.setdefault("ok", ok))
    clock.at(0.0, link.add, flow, 1e9)
    clock.at(0.1, link.fail_all)
    clock.run()
    assert done == {"ok": False}


# ------------------------------------------------------- the request path
def test_a_colocated_request_takes_the_profiles_step_times():
    prof = load_profile(H100)
    rep = run(one_site(0, 1), [request(1000, 4)], prof, router_s=0.002, rpc_s=0.0005)
    r = rep["requests"][0]
    prefill = prof.step_s(1000, 0, attention_pairs(0, 1000), 0)
    assert r["token_times"][0] - r["sent_s"] == pytest.approx(0.002 + prefill + 0.0005)
    steps = [prof.step_s(0, 1, 0, 1001 + k) for k in range(3)]
    gaps = [b - a for a, b in zip(r["token_times"], r["token_times"][1:])]
    assert gaps == pytest.approx(steps)
    assert r["placement"]["colocated"] and rep["summary"]["completed"] == 1


def test_a_disaggregated_request_pays_the_exposed_transfer_and_half_an_rtt():
    prof = load_profile(H100)
    rep = run(one_site(1, 1), [request(1000, 2)], prof, router_s=0.002, rpc_s=0.0005)
    r = rep["requests"][0]
    kv = (1000 // 16 + 1) * 16 * prof.model.kv_bytes_per_token(prof.dtype)  # every block, none cached
    prefill = prof.step_s(1000, 0, attention_pairs(0, 1000), 0)
    exposed = kv / 8 / (100e9 / 8)  # the last of 8 layer-wise pieces; the link keeps up with the rest
    want = 0.002 + 2 * 0.0005 + prefill + exposed + 0.0005 / 2 + 0.0005
    assert r["token_times"][0] - r["sent_s"] == pytest.approx(want, rel=1e-6)
    assert not r["placement"]["colocated"] and r["placement"]["kv_bytes"] == kv
    assert rep["per_worker"]["a/prefill/0"]["prefill_tokens"] == 1000


def test_shared_prefixes_are_found_by_the_routers_index_and_the_engines_cache():
    reqs = load_trace(SAMPLE_MOONCAKE, limit=130)  # the first reuse is request 49's
    rep = run(one_site(1, 2, policy="cost_model"), arrivals(reqs, scale=0.25))
    assert rep["summary"]["failed"] == 0
    reused = sum(len(set(r.hash_ids) & {h for q in reqs[:i] for h in q.hash_ids}) for i, r in enumerate(reqs))
    total = sum(len(r.hash_ids) for r in reqs)
    assert reused and rep["summary"]["prefix_cached_prompt_fraction"] > 0.5 * reused / total
    assert any(r["placement"]["kv_bytes"] < (r["input_tokens"] // 16) * 16 * 131072
               for r in rep["requests"] if not r["placement"]["colocated"])


def test_overload_queues_then_sheds_after_the_admission_wait():
    arr = [request(2000, 50, at=0.0, index=i) for i in range(6)]
    rep = run(one_site(0, 1, admission={"max_inflight_per_worker": 2, "admission_wait_s": 0.3}), arr)
    errors = [r["error"] for r in rep["requests"]]
    assert errors.count(None) >= 2 and any(e and e.startswith("RESOURCE_EXHAUSTED") for e in errors)


def test_each_router_counts_only_its_own_requests_in_flight():
    """Two decode workers of 2 slots each, 8 requests at once: one router starts 4 and sheds the rest after
    its admission wait; two routers (requests alternating) each fill every slot they count, so all 8 start."""
    arr = [request(3000, 200, at=0.0, index=i) for i in range(8)]
    cfg = one_site(0, 2, admission={"max_inflight_per_worker": 2, "admission_wait_s": 0.2})
    one, two = run(cfg, arr), run(cfg, arr, routers=2)
    shed = [r["error"] for r in one["requests"] if r["error"]]
    assert len(shed) == 4 and all(e.startswith("RESOURCE_EXHAUSTED") for e in shed)
    assert two["summary"]["failed"] == 0
    assert two["meta"]["sim"]["routers"] == 2


def test_a_lagging_view_learns_a_workers_cache_at_its_next_heartbeat():
    """The same prompt twice, 0.5 s apart, two prefill workers: with exact views the router sends the
    second where the first left its blocks (its prefill or its decode worker), expecting their help; with
    2 s heartbeats its index cannot know of them yet: it expects no help (the engine may still find them,
    by chance of the choice)."""
    first, again = request(4000, 4, at=0.0, index=0), request(4000, 4, at=0.5, index=1)
    again.hash_ids, first.hash_ids, again.trace_block = [7] * 8, [7] * 8, 512
    cfg = one_site(2, 1, policy="cost_model")
    exact, lagging = run(cfg, [first, again]), run(cfg, [first, again], heartbeat_s=2.0)
    assert exact["requests"][1]["cached_tokens"] >= 3584
    assert lagging["requests"][1]["placement"]["estimated_ttft_ms"] > exact["requests"][1]["placement"][
        "estimated_ttft_ms"]


def test_routers_and_heartbeats_are_checked():
    with pytest.raises(ValueError, match="routers must be at least 1"):
        run(one_site(0, 1), [request(100, 2)], routers=0)


# --------------------------------------------------------------- failures
def test_a_decode_worker_dying_mid_stream_migrates_without_losing_tokens():
    arr = [request(800, 200, at=0.01 * i, index=i) for i in range(4)]
    rep = run(one_site(1, 2), arr, failures=[Failure("worker", "a/decode/0", 0.5)])
    assert rep["summary"]["failed"] == 0
    assert all(len(r["token_times"]) == 200 for r in rep["requests"])
    moved = [r for r in rep["requests"] if r["placement"]["migrations"]]
    assert moved and all(r["placement"]["decode_worker"] == "a/decode/1" for r in moved)


def test_a_link_down_is_avoided_and_used_again_once_up():
    cfg = {"router": {"placement": {"policy": "least_loaded", "colocate_below_tokens": 0}},  # always disaggregates
           "sites": [{"name": "a", "prefill": {"replicas": 1}, "decode": {"replicas": 0}},
                     {"name": "b", "prefill": {"replicas": 0}, "decode": {"replicas": 1}}],
           "links": [{"between": ["a", "b"], "rtt_ms": 10, "gbps": 400}]}
    arr = [request(2000, 2, at=float(i), index=i) for i in range(5)]
    rep = run(cfg, arr, failures=[Failure("link", "a-b", 0.5, for_s=2.0)])
    assert rep["summary"]["failed"] == 0
    placed = [r["placement"]["colocated"] for r in rep["requests"]]
    assert placed == [False, True, True, False, False]


def test_a_worker_named_by_a_failure_must_exist(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "sim", "--trace", str(SAMPLE_AZURE), "--profile", H100,
                          "--fail", "worker:local/decode/7@1", "--out", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and "local/decode/7" in out.stderr and "local/decode/0" in out.stderr


# ------------------------------------------------------------ determinism
def _sim_json(tmp: Path, seed: int, hashseed: str) -> dict:
    out = tmp / f"{seed}-{hashseed}"
    subprocess.run([sys.executable, "-m", "kvrelay.cli", "sim", "--trace", str(SAMPLE_MOONCAKE), "--limit", "60",
                    "--length-scale", "0.25", "--profile", "a100:llama-3.1-8b", "--config", "examples/two-sites.yaml",
                    "--seed", str(seed), "--no-plots", "--out", str(out)],
                   check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": hashseed},
                   cwd=Path(__file__).resolve().parents[2])
    rep = json.loads((out / "report.json").read_text())
    for volatile in ("wall_s", "started"):
        rep["meta"].pop(volatile)
    return rep


def test_the_same_seed_gives_the_same_report(tmp_path):
    a, b = _sim_json(tmp_path, 3, "1"), _sim_json(tmp_path, 3, "2")
    assert a == b


# --------------------------------------------------------------- profiles
def test_profiles_name_their_source_and_refuse_what_cannot_run():
    h = load_profile("h200:llama-3.1-70b:fp8")
    assert "H200 datasheet" in h.source and h.kv_capacity_tokens() > 100_000
    assert load_profile("b200:llama-3.1-8b").step_s(0, 1, 0, 1000) < load_profile(H100).step_s(0, 1, 0, 1000)
    for spec, words in (("a100:llama-3.1-8b:fp8", "FP8"), ("a100:llama-3.1-70b", "does not fit"),
                        ("tpu:llama-3.1-8b", "h100"), ("h100:llama-3.1-8b:int4", "dtype")):
        with pytest.raises(ProfileError, match=words):
            load_profile(spec)


def test_a_measured_profile_file_is_checked(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"kind": "measured", "model": {"name": "m", "params": 1e8, "num_layers": 2,
                                                           "hidden_size": 64, "num_kv_heads": 1, "head_dim": 64},
                             "dtype": "float32", "c0": 0.001, "c_prefill": -1, "c_decode": 0, "c_attend": 0,
                             "c_context": 0}))
    with pytest.raises(ProfileError, match="c_prefill"):
        load_profile(str(f))


def test_the_fit_recovers_known_coefficients():
    c = (0.004, 2e-4, 1e-3, 3e-9, 2e-5)
    pts = [Point(p, d, a, x, c[0] + c[1] * p + c[2] * d + c[3] * a + c[4] * x)
           for p, d, a, x in ((16, 0, 136, 0), (512, 0, 131328, 0), (0, 8, 0, 4000), (0, 32, 0, 40000),
                              (128, 8, 8256, 2000), (1024, 0, 524800, 0), (0, 1, 0, 64), (256, 0, 295040, 0))]
    got, err = fit(pts)
    assert got == pytest.approx(list(c), rel=1e-6) and err < 1e-9


# ---------------------------------------------------------------- planner
def test_the_planners_recommendation_meets_the_target_and_is_minimal():
    """On the shipped Azure code slice: what it recommends meets the
    attainment in simulation, and every deployment with one worker fewer misses."""
    base = parse_config(_two_sites())
    arr = arrivals(load_trace(SAMPLE_AZURE, limit=60), speedup=4.0)
    prof = load_profile("a100:llama-3.1-8b")
    goal = PlanGoal(slo_ttft_s=1.0, slo_tpot_s=0.06, attainment=0.9)

    def sim(cfg):
        return simulate(cfg, prof, arr, SimConfig(), Objectives(goal.slo_ttft_s, goal.slo_tpot_s), {})

    plan = Planner(base, goal, sim).plan()
    best = plan.best
    assert best is not None and best.attainment >= goal.attainment and best.workers >= 2
    assert sim(deployment(base, best.pools, best.shape))["summary"]["slo_attainment"] >= goal.attainment
    removals = 0
    for i, (site, p, d) in enumerate(best.pools):
        for k, n in ((1, p), (2, d)):
            if n:
                row = [site, p, d]
                row[k] -= 1
                smaller = best.pools[:i] + (tuple(row),) + best.pools[i + 1:]
                got = sim(deployment(base, smaller, best.shape))["summary"]["slo_attainment"]
                assert got < goal.attainment, (smaller, got)
                removals += 1
    assert removals == len([n for _, p, d in best.pools for n in (p, d) if n])
    assert plan.reason and plan.smaller


def _two_sites() -> dict:
    return {"router": {"placement": {"policy": "cost_model"}},
            "sites": [{"name": "a", "jurisdiction": "X", "prefill": {"replicas": 1, "max_replicas": 6},
                       "decode": {"replicas": 1, "max_replicas": 6}},
                      {"name": "b", "jurisdiction": "X", "prefill": {"replicas": 1, "max_replicas": 6},
                       "decode": {"replicas": 1, "max_replicas": 6}}],
            "links": [{"between": ["a", "b"], "rtt_ms": 12, "gbps": 100}],
            "local_link": {"rtt_ms": 0.2, "gbps": 200}}



# -------------------------------------------------------------------- CLI
def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd or Path(__file__).resolve().parents[2])


def test_plan_capacity_writes_its_recommendation_and_reason(tmp_path):
    got = _cli("plan", "capacity", "--trace", str(SAMPLE_AZURE), "--limit", "60", "--profile", "a100:llama-3.1-8b",
               "--slo-ttft", "1", "--slo-tpot", "0.06", "--out", str(tmp_path))
    assert got.returncode == 0, got.stderr
    assert "Recommendation:" in got.stdout and "bound" in got.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["best"]["attainment"] >= 0.9 and (tmp_path / "cost_goodput.png").stat().st_size > 1000
    bad = _cli("plan", "capacity", "--trace", str(SAMPLE_AZURE), "--profile", H100, "--slo-ttft", "1",
               "--slo-tpot", "0.05", "--sites", "atlantis")
    assert bad.returncode == 2 and "atlantis" in bad.stderr


def test_report_compare_gives_the_relative_error_of_each_percentile(tmp_path):
    a = _sim_json(tmp_path, 1, "0")
    b = json.loads(json.dumps(a))
    b["summary"]["ttft_ms"]["p50"] = a["summary"]["ttft_ms"]["p50"] * 1.25
    for name, rep in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(rep))
    got = _cli("report", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert got.returncode == 0 and "| TTFT p50 |" in got.stdout and "+25.0%" in got.stdout
    assert _cli("report", "compare", str(tmp_path / "a.json"), str(tmp_path / "nope.json")).returncode == 2


def test_bench_placement_json_has_its_stable_fields(tmp_path):
    got = _cli("bench", "placement", "--workers", "40,80", "--decisions", "30", "--prompt-tokens", "512",
               "--json", str(tmp_path / "p.json"))
    assert got.returncode == 0, got.stderr
    res = json.loads((tmp_path / "p.json").read_text())["results"]
    assert [r["workers"] for r in res] == [40, 80]
    for r in res:
        for k in ("hashing", "lookup", "place", "decision", "on_loop"):
            assert 0 < r[f"{k}_p50_us"] <= r[f"{k}_p99_us"]
        assert r["decision_p50_us"] >= r["on_loop_p50_us"] >= r["place_p50_us"]
    assert _cli("bench", "placement", "--workers", "ten").returncode == 2


def test_a_few_bytes_late_in_a_long_run_still_drain():
    """Far into a run a flow's last byte may take less time than the clock can
    represent; the link retires it instead of rescheduling itself forever."""
    clock, link = _link(gbps=400.0)
    done = {}
    flow = link.open(lambda ok: done.setdefault("t", clock.now))
    clock.at(3600.0, link.add, flow, 1.3e-3)
    clock.at(3600.0, link.close, flow)
    clock.run(until=3601.0)
    assert done and clock.events < 10


def test_a_request_longer_than_a_worker_holds_is_refused_not_queued():
    prof = load_profile(H100)
    rep = run(one_site(1, 1), [request(200_000, 10), request(1000, 2, index=1)], prof)
    first, second = rep["requests"]
    assert first["error"].startswith("INVALID_ARGUMENT") and "131072" in first["error"]
    assert second["error"] is None and len(second["token_times"]) == 2


def test_what_the_simulator_does_not_model_is_refused():
    from kvrelay.benchmarks.sim.cluster import SimInputError

    dedicated = one_site(1, 1)
    dedicated["tenants"] = [{"name": "lab", "token_sha256": "0" * 64}]
    dedicated["sites"][0]["decode"]["tenants"] = ["lab"]
    with pytest.raises(SimInputError, match=r"a.decode"):
        run(dedicated, [request(100, 2)])
    with pytest.raises(SimInputError, match="does not come back"):
        run(one_site(1, 1), [request(100, 2)], failures=[Failure("worker", "a/decode/0", 1.0, for_s=5.0)])


def test_a_link_that_slows_down_is_measured_and_placement_moves_off_it():
    """Issue 35's item 3 in the simulator: the link drops from 100 to 2 Gbit/s at 20 s. The transfers
    that cross it afterwards are link-bound, the router's estimate (router/placement/link_estimate.py,
    the live router's code) reaches the new rate within ten of them (two: min_samples), and the cost
    model stops sending prompts across: the decode site computes them itself, though that stalls its
    running streams. (The estimate learns from transfers that landed: those placed before then pay.)"""
    cfg = {"router": {"placement": {"policy": "cost_model", "colocate_below_tokens": 0}},
           "sites": [{"name": "a", "prefill": {"replicas": 1}, "decode": {"replicas": 0}},
                     {"name": "b", "prefill": {"replicas": 0}, "decode": {"replicas": 1}}],
           "links": [{"between": ["a", "b"], "rtt_ms": 10, "gbps": 100}]}
    arr = [request(4000, 200, at=2.0 * i, index=i) for i in range(40)]
    rep = run(cfg, arr, rate_changes=[RateChange("a-b", 20.0, 2.0)])
    assert rep["summary"]["failed"] == 0
    (change,) = rep["meta"]["rate_changes"]
    assert change["transfers_to_track"] is not None and change["transfers_to_track"] <= 10, change
    assert change["seconds_to_track"] < 10, change
    link = rep["meta"]["links"]["a-b"]
    assert link["configured_gbps"] == 100 and link["rate_source"] == "measured", link
    assert link["placement_gbps"] == pytest.approx(2.0, rel=0.02), link
    crossed = [not r["placement"]["colocated"] for r in rep["requests"]]
    assert sum(crossed[:10]) >= 8, crossed  # before: the fast link beats stalling b's streams
    assert not any(crossed[-20:]), crossed  # after: it does not
    bad = rep["meta"]["sim"]["rate_changes"]
    assert bad == [{"link": "a-b", "at_s": 20.0, "gbps": 2.0}]


def test_a_rate_change_must_name_a_link_and_a_rate(tmp_path):
    base = [sys.executable, "-m", "kvrelay.cli", "sim", "--trace", str(SAMPLE_AZURE), "--profile", H100,
            "--config", "examples/two-sites.yaml", "--limit", "5", "--no-plots", "--out", str(tmp_path)]
    root = Path(__file__).resolve().parents[2]
    for flag, says in (("toronto-nowhere@1=2", "no such link"), ("oops", "expected A-B@SECONDS=GBPS"),
                       ("montreal-toronto@1=0", "must be positive")):
        out = subprocess.run([*base, "--link-rate", flag], capture_output=True, text=True, cwd=root)
        assert out.returncode == 2 and says in out.stderr, (flag, out.stderr)
