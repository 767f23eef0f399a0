"""``kvrelay bench vllm-pd``'s choices, checked before anything starts: unknown systems are refused by
name; and what the proxy of vLLM's own P/D (benchmarks/vllm_nixl.py) sends its prefill instance."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.benchmarks.vllm_nixl import REMOTE_DECODE, prefill_body
from kvrelay.launch import vllm_env


def test_unknown_systems_are_refused_by_name():
    if vllm_env.installed_version() is None:
        pytest.skip("vllm is not installed (make test installs it)")
    got = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "vllm-pd", "--systems", "vllm_alone,sglang"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert got.returncode == 1, got.stderr
    assert "--systems: unknown sglang (known: vllm_alone, vllm_nixl_pd, kvrelay_vllm, kvrelay_builtin)" in got.stderr


def test_the_prefill_instance_computes_one_token_and_keeps_the_blocks_for_a_remote_decode():
    body = {"model": "m", "prompt": "hi", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0}
    sent = prefill_body(body)
    assert sent == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0,
                    "kv_transfer_params": REMOTE_DECODE}
    assert REMOTE_DECODE["do_remote_decode"] is True and REMOTE_DECODE["do_remote_prefill"] is False
    assert body["max_tokens"] == 64 and body["stream"] is True  # the decode instance gets the client's request
