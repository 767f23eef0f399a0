"""Generates the Python stubs of proto/kvrelay/v1/*.proto into proto/kvrelay/v1/.

Run: python proto/codegen.py        (rewrites the checked-in stubs)
     python proto/codegen.py --check (exit 1 if the checked-in stubs are stale)

The stubs are made by the grpcio-tools of the locks (requirements/): a stale stub
is named with the generator that made it and the one installed, so a drift of
grpcio-tools (a new release, an environment not installed from the lock) reads
as what it is.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def generate(out: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvrelay" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main(["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
                      f"--grpc_python_out={out}", *protos])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted((out / "kvrelay" / "v1").glob("*_pb2*.py*"))


MARKERS = (("grpcio-tools", re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'", re.M)),
           ("protoc", re.compile(r"^# Protobuf Python Version: (\S+)", re.M)))
"""What a generated stub says of the generator that made it."""


def generator(files: list[Path]) -> str:
    """The generator versions ``files`` name, e.g. ``grpcio-tools 1.85.4, protoc 7.35.1``."""
    text = "".join(f.read_text() for f in files if f.exists())
    found = [f"{name} {'/'.join(sorted(set(rx.findall(text))))}" for name, rx in MARKERS if rx.search(text)]
    return ", ".join(found) or "no generator named"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        dest = ROOT / "kvrelay" / "v1"
        if args.check:
            stale = [f.name for f in files if not (dest / f.name).exists() or not filecmp.cmp(f, dest / f.name, False)]
            if stale:
                print(f"stale generated stubs: {', '.join(stale)}: the checked-in ones were made by "
                      f"{generator([dest / f.name for f in files])}, the installed generator makes "
                      f"{generator(files)}; install from the lock (make install) or, after make lock, run "
                      "python proto/codegen.py", file=sys.stderr)
                return 1
            return 0
        for f in files:
            shutil.copy(f, dest / f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
