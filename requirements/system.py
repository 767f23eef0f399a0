"""What `make test` installs besides the Python locks, pinned and recorded: Debian's packages
(requirements/debian.txt), the npm provider (tests/oidc/package-lock.json), and what the tests find.

    python3 requirements/system.py install PACKAGE   # as root: PACKAGE at its recorded version (else say why)
    python3 requirements/system.py versions          # what this machine has, beside what is recorded

Standard library only: it runs before any virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEBIAN = HERE / "debian.txt"
OIDC = ROOT / "tests" / "oidc"
APT_TIMEOUT_S = 900.0
QUERY_TIMEOUT_S = 30.0


def recorded() -> dict[str, str]:
    """requirements/debian.txt: package -> the version the suite last passed with."""
    out = {}
    for line in DEBIAN.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("=")
            out[name] = version
    return out


def installed(package: str) -> str | None:
    """The version dpkg has installed of ``package``, or None."""
    if shutil.which("dpkg-query") is None:
        return None
    r = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Status} ${Version}", package], capture_output=True,
                       text=True, timeout=QUERY_TIMEOUT_S, check=False)
    status, _, version = r.stdout.partition(" ")
    return version if r.returncode == 0 and status == "installed" else None


def _apt(*args: str) -> bool:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S,
                       check=False)
    return r.returncode == 0


def install(package: str) -> int:
    """Installs ``package`` at its recorded version where it is missing (as root; else a warning that its
    tests will be skipped); when the archive no longer has that version, the archive's, saying so."""
    want = recorded().get(package)
    if want is None:
        print(f"{package} is not in requirements/debian.txt: record it there first", file=sys.stderr)
        return 2
    have = installed(package)
    if have is not None:
        if have != want:
            print(f"note: {package} {have} is installed; the suite last passed with {want} (requirements/debian.txt)")
        return 0
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(f"warning: {package} is not installed and this is not root with apt-get: its tests will be skipped")
        return 0
    pinned = f"{package}={want}"
    if _apt("install", "-y", "-q", pinned) or (_apt("update", "-q") and _apt("install", "-y", "-q", pinned)):
        return 0
    if _apt("install", "-y", "-q", package):
        print(f"warning: Debian's archive no longer has {pinned}; installed {package} {installed(package)} "
              "instead (record it in requirements/debian.txt after a green run)")
        return 0
    print(f"warning: could not install Debian's {package}: its tests will be skipped")
    return 0


def _node_package(name: str) -> tuple[str | None, str | None]:
    """(the version tests/oidc's lock names, the version installed) of the npm package ``name``."""
    lock = json.loads((OIDC / "package-lock.json").read_text())
    want = lock.get("packages", {}).get(f"node_modules/{name}", {}).get("version")
    meta = OIDC / "node_modules" / name / "package.json"
    have = json.loads(meta.read_text()).get("version") if meta.exists() else None
    return want, have


def _command_version(*cmd: str) -> str:
    if shutil.which(cmd[0]) is None:
        return "not found"
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False)
    return (r.stdout or r.stderr).strip().splitlines()[0] if (r.stdout or r.stderr).strip() else "?"


def versions() -> list[str]:
    """A line per thing the suite runs beside Python: what is here, and what is recorded."""
    lines = []
    for package, want in recorded().items():
        have = installed(package)
        mark = "" if have == want else ("  <- NOT INSTALLED" if have is None else "  <- DIFFERS")
        lines.append(f"debian {package}: {have or '-'} (recorded {want}){mark}")
    want, have = _node_package("oidc-provider")
    mark = "" if have == want else "  <- DIFFERS"
    lines.append(f"npm oidc-provider: {have or '-'} (locked {want}){mark}")
    lines.append(f"node: {_command_version('node', '--version')}")
    lock = ROOT / ".venv" / "kvrelay-lock"
    lines.append(f"python lock: {lock.read_text().strip() if lock.exists() else '-'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="requirements/system.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="install a Debian package at its recorded version (as root)")
    inst.add_argument("package")
    sub.add_parser("versions", help="print what this machine has beside what is recorded")
    ns = ap.parse_args(argv)
    if ns.command == "install":
        return install(ns.package)
    print("what the suite runs beside Python (recorded: requirements/debian.txt, tests/oidc/package-lock.json):")
    for line in versions():
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
