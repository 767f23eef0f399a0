"""The CLI as a user runs it: `kvrelay serve` in the background, then
`kvrelay generate` and `kvrelay status`; Ctrl-C/SIGTERM stops everything."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

KVRELAY = [sys.executable, "-m", "kvrelay.cli"]


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def descendants_of(pid: int) -> list[int]:
    """Every process under ``pid`` (children, their children, ...)."""
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_serve_generate_status_and_clean_stop(smollm_path, stop_signal):
    env = {**os.environ, "KVRELAY_CACHE_DIR": str(smollm_path.parent.parent)}
    serve = subprocess.Popen([*KVRELAY, "serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    try:
        line = ""
        end = time.monotonic() + 180
        while time.monotonic() < end and "serving" not in line:
            line = serve.stdout.readline()
            assert line or serve.poll() is None, serve.stderr.read()
        addr = re.search(r"on (\S+:\d+)", line).group(1)
        # the router, the zygote (launch/zygote.py) and the prefill and decode workers it forked
        kids = descendants_of(serve.pid)
        assert len(kids) == 4, kids
        gen = subprocess.run([*KVRELAY, "generate", "--router", addr, "What is the capital of France?"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert gen.returncode == 0, gen.stderr
        assert "Paris" in gen.stdout
        status = subprocess.run([*KVRELAY, "status", "--router", addr], capture_output=True, text=True,
                                timeout=60, env=env)
        assert status.returncode == 0
        assert re.search(r"local/decode/0\s+local\s+decode\s+ok", status.stdout)
        assert re.search(r"local/prefill/0\s+local\s+prefill\s+ok", status.stdout)
        bad = subprocess.run([*KVRELAY, "generate", "--router", addr, "--temperature", "-2", "hi"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert bad.returncode == 1 and "INVALID_ARGUMENT: temperature" in bad.stderr
        serve.send_signal(stop_signal)
        assert serve.wait(60) == 0
        for pid in kids:
            end = time.monotonic() + 10
            while alive(pid) and time.monotonic() < end:
                time.sleep(0.1)
            assert not alive(pid), f"child {pid} outlived kvrelay serve"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
