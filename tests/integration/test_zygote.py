"""The zygote that forks workers (launch/zygote.py), on real processes: a
forked worker's exit code and the signal that ended it reach the launcher,
it carries its role's process name, modules other than the workers are
refused, and closing the zygote ends it."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from kvrelay.launch.zygote import Zygote
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


def test_only_worker_modules_are_started(zygote):
    with pytest.raises(ValueError, match="starts only"):
        zygote.start("os", [], {})


def test_closing_the_zygote_ends_it():
    z = Zygote()
    assert z.alive
    z.close()
    assert z.proc.poll() is not None and not z.alive
