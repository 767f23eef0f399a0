"""``kvrelay bench fuzz``, ``kvrelay bench overload`` and ``kvrelay bench
fairness``: the hardening and sharing benchmarks, each on a local cluster
of its own with the embedded model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrelay.benchmarks.fairness import FairnessConfig, format_fairness, run_fairness_bench
from kvrelay.benchmarks.fuzz import format_fuzz, run_fuzz_bench
from kvrelay.benchmarks.overload import OverloadConfig, format_overload, run_overload_bench
from kvrelay.cli.local import resolve_model


def cmd_bench_fuzz(args: argparse.Namespace) -> int:
    """Fuzzes every surface for ``--minutes``; exit 1 when anything failed, crashed or leaked."""
    if not 0 < args.minutes <= 24 * 60:
        raise SystemExit("kvrelay bench fuzz: --minutes must be in (0, 1440]")
    report = run_fuzz_bench(str(resolve_model(args.model, args.cache_dir)), args.minutes, args.seed)
    print(format_fuzz(report))
    if args.json:
        out = report.to_json() | {"command": "kvrelay bench fuzz " + " ".join(sys.argv[3:])}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if report.ok() else 1


def cmd_bench_overload(args: argparse.Namespace) -> int:
    """Offers ``--factor`` times the sustainable rate; exit 1 when a process died."""
    if args.factor <= 1 or args.seconds <= 0 or args.capacity_seconds <= 0:
        raise SystemExit("kvrelay bench overload: --factor must be > 1, --seconds and --capacity-seconds > 0")
    cfg = OverloadConfig(factor=args.factor, overload_s=args.seconds, capacity_s=args.capacity_seconds,
                         seed=args.seed)
    report = run_overload_bench(str(resolve_model(args.model, args.cache_dir)), cfg)
    print(format_overload(report))
    if args.json:
        out = report.to_json() | {"command": "kvrelay bench overload " + " ".join(sys.argv[3:])}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 1 if report.crashed else 0


def cmd_bench_fairness(args: argparse.Namespace) -> int:
    """One tenant's interactive TTFT while another's batch job saturates the cluster."""
    if args.interactive < 2 or args.job_requests < 1:
        raise SystemExit("kvrelay bench fairness: --interactive must be >= 2 and --job-requests >= 1")
    cfg = FairnessConfig(interactive=args.interactive, job_requests=args.job_requests, seed=args.seed)
    report = run_fairness_bench(str(resolve_model(args.model, args.cache_dir)), cfg)
    print(format_fairness(report))
    if args.json:
        out = report.to_json() | {"command": "kvrelay bench fairness " + " ".join(sys.argv[3:])}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0
