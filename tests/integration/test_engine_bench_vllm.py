"""`kvrelay bench engine --engine vllm` on the smallest run: kvrelay's engine
and vLLM's offline engine, with and without kvrelay's connector (each in a
process of its own), measured on the same prompts, and
the record's field names (other tools read them). Slow (vLLM's engine starts
in 35-50 s on two cores); `make test-slow` runs it, RESULTS.md has its figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvrelay.launch import vllm_env

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_bench_engine_with_vllm_has_its_stable_fields(plumbing_model, tmp_path):
    if vllm_env.installed_version() is None:
        pytest.skip("vllm is not installed (make test installs it: make vllm)")
    out = tmp_path / "engine.json"
    res = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "engine", "--model", str(plumbing_model),
                          "--engine", "vllm", "--no-reference", "--batches", "1,4", "--new-tokens", "8",
                          "--repeat", "1", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.with_suffix(".float32.json").read_text())
    assert rec["vllm_version"] == vllm_env.installed_version()
    assert rec["vllm_prefill_tok_s"] > 0 and rec["ours_prefill_tok_s"] > 0 and rec["hf_prefill_tok_s"] is None
    assert rec["vllm_connector_prefill_tok_s"] > 0 and rec["vllm_rounds"] == 1
    assert set(rec["decode"]) == {"1", "4"}
    for row in rec["decode"].values():
        assert set(row) == {"ours", "ours_decode_only", "hf", "vllm", "vllm_connector"}
        assert row["vllm"] > 0 and row["vllm_connector"] > 0 and row["ours"] > 0 and row["hf"] is None
    assert "| vLLM |" in res.stdout
