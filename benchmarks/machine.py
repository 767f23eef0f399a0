"""What every benchmark records beside its figures: the machine it ran on (lscpu), and its report
printed and written as JSON. Light (no torch): the commands that only plan or place import it too."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def emit_report(report: dict, json_path: str | None) -> None:
    """Prints a benchmark's report as JSON and, with ``json_path``, writes it there too."""
    text = json.dumps(report, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def machine() -> dict:
    """CPU model and the flags that matter for these numbers (lscpu)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    return {"cpu": info.get("Model name", "?").strip(), "cpus": os.cpu_count(),
            "flags": sorted(flags & {"aes", "vaes", "avx2", "avx512f", "avx512_bf16", "pclmulqdq", "vpclmulqdq",
                                     "sha_ni"})}
