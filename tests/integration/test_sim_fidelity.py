"""The simulator against live replays of the same trace slice, with a
profile measured in the same run: one site (a prefill and a decode worker)
and two sites across an emulated 20 ms WAN link (root only).

Sharing: every worker runs one torch thread and there are no more workers
than cores (2); the profile is measured with a neighbour engine running a
worker's load beside it (`kvrelay profile --sharing 2`), so both see the
same contention. The live run is warmed up (4 requests of other tokens).
The bound is the issue's 40% on the TTFT and TPOT medians: the measured
error on longer runs is in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "benchmarks" / "data" / "mooncake_synthetic_head200.jsonl"
SLICE = ["--trace", str(TRACE), "--limit", "16", "--length-scale", "0.02", "--output-scale", "0.1",
         "--speedup", "0.12"]
BOUND = 0.40


def kvrelay(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "UCX_MODULES": "^ib"}
    return subprocess.run([sys.executable, "-m", "cli", "--cache-dir", str(cache), *args], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def profile(tmp_path_factory, smollm_path) -> Path:
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    got = kvrelay("profile", "--model", str(smollm_path), "--threads", "1", "--sharing", "2", "--quick",
                  "--repeats", "2", "--out", str(out), cache=smollm_path.parent)
    assert got.returncode == 0, got.stderr[-3000:]
    return out


def medians(report: Path) -> dict[str, float]:
    s = json.loads(report.read_text())["summary"]
    assert s["failed"] == 0, s["failures"]
    return {"ttft": s["ttft_ms"]["p50"], "tpot": s["tpot_ms"]["p50"]}


def compare(config: str, profile: Path, tmp: Path, smollm_path: Path, *live_flags: str) -> dict:
    cache = smollm_path.parent
    live = kvrelay("bench", "replay", "--config", config, *SLICE, "--warmup", "4", "--no-progress", *live_flags,
                   "--out", str(tmp / "live"), cache=cache)
    assert live.returncode == 0, live.stderr[-3000:]
    sim = kvrelay("sim", "--config", config, *SLICE, "--profile", str(profile), "--no-plots", "--out",
                  str(tmp / "sim"), cache=cache)
    assert sim.returncode == 0, sim.stderr[-3000:]
    want, got = medians(tmp / "live" / "report.json"), medians(tmp / "sim" / "report.json")
    errors = {k: (got[k] - want[k]) / want[k] for k in want}
    print(f"{config}: live {want}, simulated {got}, errors {errors}")
    return errors


def _config(tmp: Path, name: str, smollm_path: Path) -> str:
    """The example config with the model folder the tests use."""
    text = (ROOT / "examples" / "sim" / name).read_text().replace("path: null", f"path: {smollm_path}")
    (tmp / name).write_text(text)
    return str(tmp / name)


def test_one_site_medians_within_the_bound(profile, tmp_path, smollm_path):
    errors = compare(_config(tmp_path, "one-site.yaml", smollm_path), profile, tmp_path, smollm_path)
    assert all(abs(e) <= BOUND for e in errors.values()), errors


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/dev/net/tun").exists() or not shutil.which("tc"),
    reason="the WAN emulation needs root, /dev/net/tun and iproute2's tc")


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
