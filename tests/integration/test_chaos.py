"""`kvrelay bench replay --chaos`, bounded for CI: a slice of the Azure
trace replayed fault-free, then again while workers are killed (and
replaced by the launcher) and the router is restarted. Nothing is lost and
every greedy output equals the fault-free run's. (The 300-request run with
link cuts between emulated cities is in benchmarks/RESULTS.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvrelay.benchmarks.traces import SAMPLE_AZURE
from kvrelay.cli.main import main

pytestmark = pytest.mark.model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chaos.yaml"


def any_free_ports(example: Path, tmp: Path, model: Path | None = None) -> Path:
    """A copy of ``example`` whose router takes any free ports (the example's fixed 50051 may be in use
    here), serving ``model`` where one is given."""
    raw = yaml.safe_load(example.read_text())
    raw["router"]["port"] = 0
    if model is not None:
        raw["model"]["path"] = str(model)
    copy = tmp / example.name
    copy.write_text(yaml.safe_dump(raw))
    return copy


# Not serial: the faults come at instants of the replay's clock, and what is asserted (nothing lost, no
# output changed, at least three faults) holds however busy the machine: a slower replay sees more faults.
def test_chaos_replay_loses_nothing_and_changes_no_output(tmp_path, plumbing_model, capsys):
    """On the plumbing model: what is checked is that every request's greedy tokens survive the
    faults, not what they say (the trace's timing, not the model's speed, spreads the faults)."""
    out, config = tmp_path / "chaos", any_free_ports(EXAMPLE, tmp_path, plumbing_model)
    rc = main(["bench", "replay", "--config", str(config), "--trace", str(SAMPLE_AZURE), "--limit", "16",
               "--length-scale", "0.05", "--output-scale", "0.5", "--speedup", "3", "--chaos", "40",
               "--chaos-seed", "3", "--no-progress", "--out", str(out)])
    result = json.loads((out / "chaos.json").read_text())
    assert rc == 0, (out / "chaos.md").read_text()
    assert result["requests"] == 16 and result["lost"] == [] and result["outputs_differ"] == []
    assert result["faults"] >= 3, result["fault_log"]
    assert set(result["faults_by_kind"]) <= {"kill_prefill", "kill_decode", "restart_router"}  # no links here
    # the router's own counters, kept across its restarts, saw at least what the finished placements report
    counters = result["router_counters"]
    assert counters["retries"] >= result["router_retries"] and counters["migrations"] >= result["migrations"]
    base = json.loads((out / "baseline" / "report.json").read_text())
    assert all(r["token_ids"] and len(r["token_ids"]) == r["max_tokens"] for r in base["requests"])
    assert "Chaos replay against the fault-free run" in capsys.readouterr().out


def test_chaos_refuses_a_router_of_someone_else(capsys):
    rc = main(["bench", "replay", "--router", "127.0.0.1:1", "--trace", str(SAMPLE_AZURE), "--limit", "2",
               "--chaos", "5", "--out", "/tmp/unused"])
    assert rc == 2 and "--chaos needs" in capsys.readouterr().err
