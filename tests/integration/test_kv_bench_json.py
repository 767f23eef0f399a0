"""`kvrelay bench kv --json` on the smallest run: real transfers and raw
sockets, and the record's field names (other tools read them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvrelay.cli.main import main


def test_bench_kv_json_has_its_stable_fields(tmp_path):
    out = tmp_path / "kv.json"
    res = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "kv", "--sizes", "1", "--streams", "1",
                          "--repeat", "1", "--modes", "aead,integrity", "--no-overlap", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert [(r["mode"], r["streams"]) for r in rec["rows"]] == [("aead", 1), ("integrity", 1)]
    for r in rec["rows"]:
        assert set(r) == {"size_mib", "streams", "mode", "ours_gbps", "raw_gbps", "limit_gbps", "ratio"}
        assert r["ours_gbps"] > 0 and r["limit_gbps"] > 0
        # the fields are rounded to 3 decimals: the ratio of the rounded rates may differ by that rounding
        lo = (r["ours_gbps"] - 5e-4) / (r["limit_gbps"] + 5e-4)
        hi = (r["ours_gbps"] + 5e-4) / max(1e-9, r["limit_gbps"] - 5e-4)
        assert lo - 1e-3 <= r["ratio"] <= hi + 1e-3, r
    assert rec["one_block_ms"] > 0 and rec["overlap_fraction"] is None and rec["wan_link_ratio"] is None
    assert rec["machine"]["cpu"] and "command" in rec and "date" in rec
    assert "ours / limit" in res.stdout


def test_bench_kv_refuses_an_unknown_mode():
    with pytest.raises(SystemExit) as exc:  # before anything is measured
        main(["bench", "kv", "--modes", "plain", "--no-overlap"])
    assert "protection must be aead or integrity, got 'plain'" in str(exc.value.code)


def test_bench_kv_gate_measures_a_real_sender_under_the_flood(tmp_path, capsys):
    out = tmp_path / "gate.json"
    assert main(["bench", "kv-gate", "--blocks", "1", "--transfers", "3", "--idle", "80", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["gate_pending_during_flood"] <= 64 + 1  # one address: 64 at most (+ a replay in flight)
    assert rec["replays_sent"] >= 1 and rec["replays_refused"] >= rec["replays_sent"] - 1  # only the first is new
    assert rec["quiet_ms_p50"] > 0 and rec["flood_ms_p50"] > 0 and rec["ratio_p50"] > 0
    assert rec["machine"]["cpu"] and "KV gate under a flood" in capsys.readouterr().out
