"""House rules the README states, checked from the source: functions stay
short enough to read (about 60 lines), and the packages keep their module maps."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["engine", "kvtransfer", "runtime", "prefill_worker", "decode_worker", "router", "launch", "benchmarks",
            "cli", "requirements"]
MAX_FUNCTION_LINES = 60


def long_functions(folder: Path, root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function longer than ``limit`` (docstring included)."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_function_is_longer_than_sixty_lines(pkg: str):
    assert long_functions(ROOT / pkg) == []


def test_the_check_sees_a_long_function(tmp_path: Path):
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert long_functions(tmp_path, tmp_path) == ["m.py:1 f (71 lines)"]


@pytest.mark.parametrize("pkg", ["engine", "kvtransfer", "runtime", "router", "benchmarks", "benchmarks/sim", "cli",
                                 "launch", "prefill_worker", "decode_worker", "requirements"])
def test_package_has_a_module_map(pkg: str):
    text = (ROOT / pkg / "README.md").read_text()
    modules = sorted({p.name for p in (ROOT / pkg).rglob("*.py") if p.name not in ("__init__.py", "__main__.py")})
    missing = [m for m in modules if not re.search(rf"`([\w/]+/)?{re.escape(m)}`", text)]  # name or sub/name
    assert missing == [], f"{pkg}/README.md does not list {missing}"
