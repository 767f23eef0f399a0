"""Generates the Python stubs of proto/kvrelay/v1/*.proto into proto/kvrelay/v1/.

Run: python proto/codegen.py        (rewrites the checked-in stubs)
     python proto/codegen.py --check (exit 1 if the checked-in stubs are stale)
"""

from __future__ import annotations

import argparse
import filecmp
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
                print(f"stale generated stubs: {', '.join(stale)}; run python proto/codegen.py", file=sys.stderr)
                return 1
            return 0
        for f in files:
            shutil.copy(f, dest / f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
