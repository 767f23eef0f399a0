"""The project's imports point one way (README, "Architecture"):

    proto (kvrelay.v1) <- engine <- kvtransfer <- runtime
        <- {prefill_worker, decode_worker, router} <- launch <- benchmarks <- cli

Installed, each is ``kvrelay.<package>`` (pyproject's package-dir; the
folders stay at the top of the repository): an import of a bare top-level
name (``from router.core import ...``, the old layout) is refused, as it
would load a second copy of the module from the working directory, or
nothing at all once installed elsewhere. Inside the router, its subpackages
are layers of their own (:data:`ROUTER_LAYERS`).

The graph is built from the source with ast, so it sees every import, also
those inside functions, whether or not that code runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS = [{"kvrelay"}, {"engine"}, {"kvtransfer"}, {"runtime"}, {"prefill_worker", "decode_worker", "router"},
          {"launch"}, {"benchmarks"}, {"cli"}]
"""Bottom to top; a package imports only from layers below its own (and itself)."""
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
PACKAGES = {"kvrelay": ROOT / "proto" / "kvrelay", **{p: ROOT / p for p in LAYER if p != "kvrelay"}}

FORBIDDEN = {
    "engine": {"grpc", "kvtransfer", "router", "prefill_worker", "decode_worker"},
    "kvtransfer": {"router", "prefill_worker", "decode_worker"},
    "router": {"prefill_worker", "decode_worker", "kvtransfer"},
    "prefill_worker": {"decode_worker"},
    "decode_worker": {"prefill_worker"},
}
"""The rules the README's Architecture section states outright (the layer order implies most of them)."""

LAZY_ALLOWED = {"ray", "matplotlib", "transformers", "nixl", "nixl_cu12", "mooncake", "uvicorn", "openai", "torch",
                "vllm"}
"""Heavy optional dependencies that may be imported inside a function."""


BARE = "bare"
"""What :func:`layer_of` calls an import of a project package by its old top-level name."""


def layer_of(module: str) -> str:
    """The package an imported module counts as: ``kvrelay.<package>...`` is that
    package, ``kvrelay.v1`` the protos (``kvrelay``); a project package imported
    by its bare name is BARE-prefixed (refused); anything else is its top-level name."""
    parts = module.split(".")
    if parts[0] == "kvrelay" and len(parts) > 1 and parts[1] in LAYER:
        return parts[1]
    if parts[0] in LAYER and parts[0] != "kvrelay":
        return f"{BARE}:{parts[0]}"
    return parts[0]


def project_imports(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(package imported, line, inside a function) for every import in ``tree`` (see :func:`layer_of`)."""
    out = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((layer_of(a.name), child.lineno, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.append((layer_of(child.module), child.lineno, in_func))
            elif isinstance(child, ast.ImportFrom) and child.level > 0:
                out.append((f"{BARE}:relative", child.lineno, in_func))
            visit(child, nested)

    visit(tree, False)
    return out


def graph(packages: dict[str, Path], root: Path = ROOT) -> dict[str, list[tuple[str, str, int, bool]]]:
    """package -> [(imported top-level module, file, line, inside a function)]."""
    edges: dict[str, list] = {p: [] for p in packages}
    for pkg, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # generated
            tree = ast.parse(path.read_text(), str(path))
            for mod, line, lazy in project_imports(tree):
                edges[pkg].append((mod, str(path.relative_to(root)), line, lazy))
    return edges


def package_cycles(edges: dict[str, list]) -> list[list[str]]:
    """Cycles between top-level packages (each as a path a -> ... -> a)."""
    succ = {p: sorted({m for m, *_ in e if m in edges and m != p}) for p, e in edges.items()}
    cycles, state = [], {}

    def dfs(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in succ[node]:
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                dfs(nxt, path + [nxt])
        state[node] = "done"

    for p in sorted(succ):
        if p not in state:
            dfs(p, [p])
    return cycles


def violations(edges: dict[str, list]) -> list[str]:
    """Every import that breaks the layering, the stated rules or the top-of-module rule."""
    bad = []
    for pkg, imports in edges.items():
        for mod, path, line, lazy in imports:
            where = f"{path}:{line}: {pkg} imports {mod}"
            if mod.startswith(BARE):
                bad.append(f"{where} (by its bare name: import kvrelay.<package>)")
            elif mod in FORBIDDEN.get(pkg, ()):
                bad.append(f"{where} (forbidden)")
            elif mod in LAYER and mod != pkg and LAYER[mod] >= LAYER[pkg]:
                bad.append(f"{where} (not below {pkg})")
            if lazy and (mod in LAYER):
                bad.append(f"{where} inside a function (project imports go at module top)")
    return bad


def test_no_cycles_between_top_level_packages():
    assert package_cycles(graph(PACKAGES)) == []


def test_imports_point_one_way():
    assert violations(graph(PACKAGES)) == []


def test_only_heavy_optional_dependencies_are_imported_lazily():
    lazy = sorted({(m, f"{p}:{line}") for pkg, e in graph(PACKAGES).items()
                   for m, p, line, is_lazy in e if is_lazy and m not in LAZY_ALLOWED and m not in LAYER})
    # stdlib modules imported late are harmless but say nothing: keep them at the top too
    assert lazy == [], lazy


def test_the_checks_catch_a_cycle_and_a_forbidden_import(tmp_path: Path):
    """The checker itself: a toy tree with engine -> router -> engine, a lazy
    import, and the old layout's bare names (what this test fails on: every
    import of the tree as it was before kvrelay.<package>)."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "router").mkdir()
    (tmp_path / "engine" / "a.py").write_text("import kvrelay.router.b\n")
    (tmp_path / "router" / "b.py").write_text("def f():\n    from kvrelay.engine import a\n")
    (tmp_path / "router" / "old.py").write_text("from router.core import RouterCore\nfrom engine import hashing\n")
    edges = graph({"engine": tmp_path / "engine", "router": tmp_path / "router"}, tmp_path)
    assert package_cycles(edges) == [["engine", "router", "engine"]]
    bad = violations(edges)
    assert any("engine imports router (forbidden)" in b for b in bad)
    assert any("inside a function" in b for b in bad)
    assert [b.split(": ", 1)[1] for b in bad if "bare name" in b] == [
        "router imports bare:router (by its bare name: import kvrelay.<package>)",
        "router imports bare:engine (by its bare name: import kvrelay.<package>)"]


ROUTER_LAYERS = [{"placement"}, {"cluster"}, {"core"}, {"governance"}, {"frontends"}, {"main"}, {"__main__"}]
"""The router's own layers, bottom to top (router/README.md): placement is a pure function of a view,
cluster the state the workers feed, core the request's path, governance (audit, retention, the
statement) and the front ends on top, main the composition root. A subpackage imports only from
itself and the ones below; nothing but main sits beside them."""
ROUTER_LAYER = {name: i for i, layer in enumerate(ROUTER_LAYERS) for name in layer}
ROUTER_PURE = {"placement": {"grpc", "asyncio", "socket", "sqlite3", "threading", "time", "kvrelay.v1"}}
"""What a pure layer may not import: no I/O, no clock, no RPC (placement runs in the simulator unchanged)."""


def router_layer_violations(router: Path) -> list[str]:
    """Every router module outside the layers, and every import that points up or into I/O from a pure layer."""
    bad = []
    for path in sorted(router.rglob("*.py")):
        rel = path.relative_to(router)
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if own == "__init__":
            continue
        if own not in ROUTER_LAYER:
            bad.append(f"router/{rel}: outside the router's layers {sorted(ROUTER_LAYER)}")
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["kvrelay", "router"] and len(parts) > 2:
                    target = parts[2]
                    if target not in ROUTER_LAYER or ROUTER_LAYER[target] > ROUTER_LAYER[own] or (
                            target != own and ROUTER_LAYER[target] == ROUTER_LAYER[own]):
                        bad.append(f"router/{rel}:{node.lineno}: {own} imports router.{target} (not below {own})")
                elif any(name == f or name.startswith(f + ".") for f in ROUTER_PURE.get(own, ())):
                    bad.append(f"router/{rel}:{node.lineno}: {own} imports {name} (a pure layer)")
    return bad


def test_the_router_is_layered():
    assert router_layer_violations(ROOT / "router") == []


def test_the_router_layer_check_fails_on_a_flat_router(tmp_path: Path):
    """The checker itself, on the flat router/ this layout replaced (39 modules side by side, core.py
    importing audit_writer) and on a placement that reaches up and into the clock."""
    (tmp_path / "placement").mkdir()
    (tmp_path / "core.py").write_text("from kvrelay.router.audit_writer import AuditWriter\n")
    (tmp_path / "relay.py").write_text("")
    (tmp_path / "placement" / "place.py").write_text("import time\nfrom kvrelay.router.core.errors import X\n")
    (tmp_path / "main.py").write_text("from kvrelay.router.placement.place import place\n")
    assert router_layer_violations(tmp_path) == [
        "router/core.py:1: core imports router.audit_writer (not below core)",
        "router/placement/place.py:1: placement imports time (a pure layer)",
        "router/placement/place.py:2: placement imports router.core (not below placement)",
        "router/relay.py: outside the router's layers ['__main__', 'cluster', 'core', 'frontends', 'governance', "
        "'main', 'placement']"]


@pytest.mark.parametrize("pkg", sorted(p for p in LAYER if p != "kvrelay"))
def test_every_layer_exists(pkg: str):
    assert (PACKAGES[pkg] / "__init__.py").is_file()


def test_the_router_process_does_not_load_torch():
    """The router tokenizes, hashes and places; it runs no model. Loading torch
    would cost it ~180 MB and ~1 s at every start (measured: 257 -> 77 MB)."""
    import subprocess
    import sys

    probe = "import sys, kvrelay.router.main; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr)


CLIENT_COMMANDS = ["generate", "status", "job", "usage", "audit", "scale", "drain", "plan", "governance", "trace",
                   "pki", "sim", "cities"]
"""Commands that talk to a running cluster or read files: none runs a model here."""


def test_the_client_commands_load_neither_torch_nor_the_engine():
    """`kvrelay generate` (and every command in CLIENT_COMMANDS) parses its
    arguments and runs without torch or the engine's model code: a client call
    costs ~0.3 s of imports instead of ~2 s. Checked on the real entry point."""
    import subprocess
    import sys

    probe = ("import sys\nfrom kvrelay.cli.main import main\n"
             "for c in sys.argv[1:]:\n"
             "    try:\n        main([c, '--help'])\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
             " or m.startswith(('kvrelay.engine.llm_engine', 'kvrelay.engine.model')))[:3], file=sys.stderr)")
    res = subprocess.run([sys.executable, "-c", probe, *CLIENT_COMMANDS], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stderr.strip().splitlines()[-1] == "[]", (res.stdout[-500:], res.stderr)
    assert "usage: kvrelay generate" in res.stdout  # the commands were really parsed


def test_a_client_call_reads_its_arguments_without_the_simulator_or_the_config_validation():
    """generate and the client commands of cli/main.py's CLIENT_COMMANDS are parsed by their own
    module alone: no pydantic, config validation, simulator or benchmark is imported (what kept
    `kvrelay generate --help` above 0.5 s). It fails on a parser that imports every command's module."""
    import subprocess
    import sys

    from kvrelay.cli.main import CLIENT_COMMANDS as LIGHT

    heavy = ("pydantic", "kvrelay.runtime.config", "kvrelay.benchmarks", "kvrelay.cli.sim", "kvrelay.launch.local")
    probe = ("import sys\nfrom kvrelay.cli.main import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             f"print(sorted(m for m in sys.modules if m.startswith({heavy!r}))[:3], file=sys.stderr)")
    # trace reads span files with runtime/tracing.py, which knows the config's telemetry section
    for command in ["generate", *(c for c in LIGHT if c != "trace")]:
        res = subprocess.run([sys.executable, "-c", probe, command, "--help"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0 and res.stderr.strip().splitlines()[-1] == "[]", (command, res.stderr[-800:])
        assert f"usage: kvrelay {command}" in res.stdout, (command, res.stdout[:300])


def test_the_commands_that_run_no_model_here_start_without_torch():
    """cli/local.py (serve, model prepare, demo, placement...) imports neither torch nor vLLM: its
    import took 5.7 s, 3 s of it torch's, before the commands that run torch here moved to
    cli/compute.py (and the GGUF conversion wrote its safetensors with numpy's writer). A refused
    argument is answered by the command itself. It fails on a torch module imported at its top."""
    import subprocess
    import sys

    probe = ("import sys\nfrom kvrelay.cli import local\nfrom kvrelay.cli.main import main\n"
             "rc = main(['bench', 'placement', '--workers', 'ten'])\n"
             "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'))[:3])")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "2 []", res.stdout[-800:] + res.stderr[-800:]
    assert "--workers takes comma-separated counts" in res.stderr


def test_a_client_command_parsed_alone_is_parsed_as_in_the_whole_parser():
    """The light parser of each client command (its module alone) gives the same help, so the same
    arguments, as the parser of every command."""
    import argparse

    from kvrelay.cli.main import CLIENT_COMMANDS as LIGHT
    from kvrelay.cli.main import build_parser

    def command(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return subs.choices[name]

    whole = build_parser()
    for name in ["generate", *LIGHT]:
        assert command(build_parser(name), name).format_help() == command(whole, name).format_help(), name
    assert "capacity" in command(build_parser("plan"), "plan").format_help()


@pytest.mark.parametrize("argv,command", [
    (["generate", "hi"], "generate"), (["--cache-dir", "status", "generate", "hi"], "generate"),
    (["--cache", "status", "job", "list"], "job"), (["--cache-dir=/tmp/x", "status"], "status"),
    (["--help"], None), (["-h"], None), ([], None)])
def test_the_command_is_found_past_the_global_option_and_its_value(argv: list[str], command: str | None):
    """A cache folder named like a client command does not pick that command's light parser."""
    from kvrelay.cli.main import command_of

    assert command_of(argv) == command


def test_every_lazily_imported_command_exists():
    """A command run through cli/lazy.py names a function that exists (found
    here, not when a user first runs the command)."""
    import argparse
    import importlib

    from kvrelay.cli.lazy import Lazy
    from kvrelay.cli.main import build_parser

    def lazies(parser) -> list[Lazy]:
        found = [parser.get_default("func")]
        for action in parser._actions:  # argparse keeps subparsers only here
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += lazies(sub)
        return [f for f in found if isinstance(f, Lazy)]

    found = lazies(build_parser())
    assert len(found) >= 15, found
    for lazy in found:
        assert callable(getattr(importlib.import_module(lazy.module), lazy.name, None)), lazy
