"""The zygote that forks workers (launch/zygote.py), on real processes: a
forked worker's exit code and the signal that ended it reach the launcher,
it carries its role's process name, modules other than the workers are
refused, a child asked for with a piped stdout writes there (the router's
READY line reaches the launcher so), a request that says so but brings no
descriptor is refused, and closing the zygote ends it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from kvrelay.launch.zygote import Zygote, _fork
from kvrelay.runtime.config import dump_config, parse_config
from tests.integration.helpers import CLUSTER_YAML


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def test_a_bad_flag_exits_with_argparses_code(zygote):
    bad = zygote.start("kvrelay.decode_worker", ["--no-such-flag"], {"PATH": "/usr/bin"})
    assert bad.wait(60) == 2
    assert bad.poll() == bad.returncode == 2


def test_a_killed_worker_reports_the_signal(zygote, tmp_path, smollm_path):
    config = tmp_path / "cluster.yaml"
    dump_config(parse_config({**CLUSTER_YAML, "tls": {"enabled": False}}), config)
    # a worker with nothing to register with (port 1): it loads its model, then waits for a router
    worker = zygote.start("kvrelay.decode_worker", ["--config", str(config), "--model-path", str(smollm_path),
                                                    "--router", "127.0.0.1:1", "--site", "local", "--index", "0"],
                          {"PATH": "/usr/bin", "KVRELAY_KV_SECRET": "s" * 64})
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(0.2)
    assert Path(f"/proc/{worker.pid}/comm").read_text().strip() == "kvrelay-decode"  # what ps and top show
    worker.kill()
    assert worker.wait(30) == -signal.SIGKILL


def test_a_child_with_a_piped_stdout_writes_there(zygote):
    """argparse's --help goes to standard output: through the pipe, not the zygote's."""
    child = zygote.start("kvrelay.router", ["--help"], {"PATH": "/usr/bin"}, stdout=True)
    assert child.stdout is not None
    with child.stdout:
        text = child.stdout.read()
    assert child.wait(60) == 0 and "usage:" in text and "--config" in text


def test_a_piped_stdout_without_its_descriptor_is_refused():
    here, there = socket.socketpair()
    with here, there:
        _fork(there, json.dumps({"module": "kvrelay.router", "args": [], "env": {}, "stdout": True}).encode(), [])
        answer = json.loads(here.recv(1 << 16).split(b"\n")[0])
    assert answer == {"refused": "a request for a piped stdout came without its descriptor"}


def test_only_worker_modules_are_started(zygote):
    with pytest.raises(ValueError, match="starts only"):
        zygote.start("os", [], {})


def test_closing_the_zygote_ends_it():
    z = Zygote()
    assert z.alive
    z.close()
    assert z.proc.poll() is not None and not z.alive
