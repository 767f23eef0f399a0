"""The wheel as pip builds it: one import root. Installed next to anything
else, kvrelay must not shadow or be shadowed by another distribution's
`cli`, `router` or `engine`: every package is kvrelay.<package>, with its
data files, and the command points into it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_only_kvrelay(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    wheel = next(tmp_path.glob("kvrelay-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"kvrelay"}, sorted(top)
    for must in ("kvrelay/router/core/pipeline.py", "kvrelay/router/frontends/jobs.py", "kvrelay/engine/llm_engine.py",
                 "kvrelay/cli/main.py", "kvrelay/v1/inference_pb2.py", "kvrelay/v1/inference.proto",
                 "kvrelay/benchmarks/sim/run.py"):
        assert must in names, must
    assert any(n.startswith("kvrelay/benchmarks/data/") and n.endswith(".csv") for n in names)
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kvrelay = kvrelay.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
