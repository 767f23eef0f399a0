"""The simulator against live replays of the same trace slice, with a
profile measured in the same run: one site (a prefill and a decode worker)
and two sites across an emulated 20 ms WAN link (root only).

Sharing: every worker runs one torch thread and there are no more workers
than cores (2); the profile is measured with a neighbour engine running a
worker's load beside it (`kvrelay profile --sharing 2`), so both see the
same contention. The live run is warmed up (4 requests of other tokens).
The bound is the issue's 40% on the TTFT and TPOT medians: the measured
error on longer runs is in benchmarks/RESULTS.md.

The two 40% comparisons are measurements (a live run's latency against a
profile taken minutes earlier: a machine busy in one and not the other moves
them), so they are marked slow (`make test-slow`) and their figures live in
benchmarks/RESULTS.md. CI runs the bounded sibling: the same pipeline on
fewer requests and the plumbing model, asserting what holds on a busy machine too (the simulator
replays the live slice request for request, to the token, and its medians are
within a factor of LOOSE of the live ones). Only the two measurements are
marked serial (run alone): the sibling runs beside the other tests, whose load
its bound allows for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "benchmarks" / "data" / "mooncake_synthetic_head200.jsonl"
SLICE = ["--trace", str(TRACE), "--limit", "16", "--length-scale", "0.02", "--output-scale", "0.1",
         "--speedup", "0.12"]
BOUND = 0.40
LOOSE = 4.0
"""The CI sibling's bound on simulated / live medians (either way): what a
profile measured on the same machine in the same run keeps, however busy."""


def kvrelay(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "UCX_MODULES": "^ib"}
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", "--cache-dir", str(cache), *args], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env=env)


def _profile(out: Path, model: Path, repeats: int) -> Path:
    got = kvrelay("profile", "--model", str(model), "--threads", "1", "--sharing", "2", "--quick",
                  "--repeats", str(repeats), "--out", str(out), cache=model.parent)
    assert got.returncode == 0, got.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def profile(tmp_path_factory, smollm_path) -> Path:
    return _profile(tmp_path_factory.mktemp("profile") / "profile.json", smollm_path, 2)


def medians(report: Path) -> dict[str, float]:
    s = json.loads(report.read_text())["summary"]
    assert s["failed"] == 0, s["failures"]
    return {"ttft": s["ttft_ms"]["p50"], "tpot": s["tpot_ms"]["p50"]}


def replay_both(config: str, profile: Path, tmp: Path, model: Path, *live_flags: str,
                trace_slice: list[str] = SLICE, warmup: int = 4) -> None:
    """A live replay of the slice into ``tmp/live``, its simulation into ``tmp/sim``."""
    cache = model.parent
    live = kvrelay("bench", "replay", "--config", config, *trace_slice, "--warmup", str(warmup), "--no-progress",
                   *live_flags, "--out", str(tmp / "live"), cache=cache)
    assert live.returncode == 0, live.stderr[-3000:]
    sim = kvrelay("sim", "--config", config, *trace_slice, "--profile", str(profile), "--no-plots", "--out",
                  str(tmp / "sim"), cache=cache)
    assert sim.returncode == 0, sim.stderr[-3000:]


def compare(config: str, profile: Path, tmp: Path, smollm_path: Path, *live_flags: str) -> dict:
    replay_both(config, profile, tmp, smollm_path, *live_flags)
    want, got = medians(tmp / "live" / "report.json"), medians(tmp / "sim" / "report.json")
    errors = {k: (got[k] - want[k]) / want[k] for k in want}
    print(f"{config}: live {want}, simulated {got}, errors {errors}")
    return errors


def _config(tmp: Path, name: str, model: Path) -> str:
    """The example config with the model folder the tests use, its router on any free ports."""
    raw = yaml.safe_load((ROOT / "examples" / "sim" / name).read_text())
    raw["model"]["path"] = str(model)
    raw["router"]["port"] = 0
    (tmp / name).write_text(yaml.safe_dump(raw))
    return str(tmp / name)


def test_the_simulator_replays_a_live_slice_request_for_request(tmp_path, plumbing_model):
    """CI's bounded sibling of the two measurements below (see the module's docstring), on the plumbing
    model: what it asserts is the pipeline (profile, live replay, simulation of the same slice), which
    holds for any model; the measurements keep SmolLM2 (99 core-s on SmolLM2 here, a third of it the
    profile)."""
    profile = _profile(tmp_path / "profile.json", plumbing_model, 1)
    # the first 5 requests of the slice at half its prompt lengths, after 2 warm-up requests
    short = [*SLICE[:3], "5", SLICE[4], "0.01", *SLICE[6:]]
    replay_both(_config(tmp_path, "one-site.yaml", plumbing_model), profile, tmp_path, plumbing_model,
                trace_slice=short, warmup=2)
    live, sim = (json.loads((tmp_path / k / "report.json").read_text()) for k in ("live", "sim"))
    assert len(live["requests"]) == len(sim["requests"]) == 5
    lengths = [(r["input_tokens"], len(r["token_times"])) for r in live["requests"]]
    assert lengths == [(r["input_tokens"], len(r["token_times"])) for r in sim["requests"]]
    want, got = medians(tmp_path / "live" / "report.json"), medians(tmp_path / "sim" / "report.json")
    assert all(1 / LOOSE <= got[k] / want[k] <= LOOSE for k in want), (want, got)


@pytest.mark.slow
@pytest.mark.serial
def test_one_site_medians_within_the_bound(profile, tmp_path, smollm_path):
    errors = compare(_config(tmp_path, "one-site.yaml", smollm_path), profile, tmp_path, smollm_path)
    assert all(abs(e) <= BOUND for e in errors.values()), errors


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/dev/net/tun").exists() or not shutil.which("tc"),
    reason="the WAN emulation needs root, /dev/net/tun and iproute2's tc")


@pytest.mark.slow
@pytest.mark.serial
@needs_root
def test_two_sites_across_an_emulated_wan_within_the_bound(profile, tmp_path, smollm_path):
    config = _config(tmp_path, "two-sites.yaml", smollm_path)
    state = tmp_path / "cities"
    up = kvrelay("cities", "up", "--config", config, "--state-dir", str(state), "--prefix", "kvsf",
                 "--subnet", "10.219.0.0/16", cache=smollm_path.parent)
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        errors = compare(config, profile, tmp_path, smollm_path, "--cities", "--state-dir", str(state))
    finally:
        down = kvrelay("cities", "down", "--state-dir", str(state), cache=smollm_path.parent)
    assert down.returncode == 0, down.stderr[-2000:]
    assert all(abs(e) <= BOUND for e in errors.values()), errors
