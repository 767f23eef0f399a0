"""Helpers the `kvrelay` command modules share."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
from pathlib import Path

import grpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

from benchmarks.replay import (
    ReplayConfig,
    build_report,
    check_lengths,
    replay,
    trace_slice,
    write_report,
)
from benchmarks.traces import build_prompts
from engine.default_model import prepare_default_model
from runtime.rpc import sync_channel


def default_cache_dir() -> Path:
    """``$KVRELAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrelay``, else ``~/.cache/kvrelay``."""
    if os.environ.get("KVRELAY_CACHE_DIR"):
        return Path(os.environ["KVRELAY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvrelay"


def resolve_model(arg: str | None, cache_dir: Path) -> Path:

    return Path(arg) if arg else prepare_default_model(cache_dir)


VOCAB_RANGE = (100, 10000)
"""Token ids of replayed prompts: inside any real vocabulary, clear of special tokens."""


def client_metadata() -> tuple:
    """gRPC metadata with the client (tenant) token from $KVRELAY_API_KEY, for
    routers whose config lists auth.clients; empty when it is not set."""
    token = os.environ.get("KVRELAY_API_KEY", "")
    return (("authorization", f"Bearer {token}"),) if token else ()


def grpc_error(exc) -> int:
    print(f"kvrelay: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1


def table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())


def default_token_file() -> Path:
    """Where `kvrelay serve` writes its per-run operator token: beside the model cache."""
    return default_cache_dir() / "operator-token"


def write_secret(path: Path, value: str) -> None:
    """Writes ``value`` to ``path``, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    tmp.rename(path)


def replay_config(args: argparse.Namespace):
    """The replay settings given on the command line."""

    return ReplayConfig(speedup=args.speedup, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                        progress=not args.no_progress)


def replay_prompts(args: argparse.Namespace, reqs, address: str) -> tuple[list, dict] | int:
    """The prompts to replay, their lengths checked against the model the
    router at ``address`` serves, and the report's metadata; an exit code
    (after saying why) when they cannot be replayed."""


    with sync_channel(address) as ch:
        try:
            model = igrpc.InferenceStub(ch).ListModels(ipb.ListModelsRequest(), timeout=30).models[0]
        except grpc.RpcError as exc:
            return grpc_error(exc)
    scale = args.length_scale or 1.0
    out_scale = getattr(args, "output_scale", None)
    too_long = check_lengths(reqs, scale, model.context_window, out_scale)
    if too_long and args.length_scale is None:
        worst = max(r.input_tokens + r.output_tokens for r in reqs)
        print(f"kvrelay: {len(too_long)} of {len(reqs)} requests exceed {model.name}'s context window of "
              f"{model.context_window} tokens (longest {worst}); pass --length-scale, e.g. "
              f"--length-scale {0.95 * model.context_window / worst:.3g}", file=sys.stderr)
        return 2
    reason = ""
    if args.length_scale is not None:
        reason = f"--length-scale {scale:g} given" + (f", outputs {out_scale:g}" if out_scale is not None else "")
        if too_long:
            reason += f"; {len(too_long)} request(s) still exceed the context window and are sent anyway " \
                      "(they fail and are reported)"
    meta = {"trace": str(args.trace), "format": args.format or "auto", "limit": args.limit,
            "speedup": args.speedup, "length_scale": scale, "output_scale": out_scale, "scale_reason": reason,
            "seed": args.seed, "model": model.name, "context_window": model.context_window}
    return build_prompts(reqs, scale, VOCAB_RANGE, seed=args.seed, out_scale=out_scale), meta


def run_meta(reqs, address: str, cluster) -> dict:
    """The report's metadata about one run: where it ran, on what."""


    return {"router": address, "policy": cluster.cfg.router.policy if cluster is not None else "?",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wan_emulation": cluster is not None and cluster.cities is not None,
            "config": cluster.cfg.to_dict() if cluster is not None else None, "trace_slice": trace_slice(reqs)}


def run_replay(args: argparse.Namespace, reqs, address: str, cluster) -> int:
    """Replays ``reqs`` against the router at ``address``; writes and prints the report."""


    got = replay_prompts(args, reqs, address)
    if isinstance(got, int):
        return got
    prompts, meta = got
    rcfg = replay_config(args)
    meta |= run_meta(reqs, address, cluster)
    records, samples = asyncio.run(replay(address, prompts, rcfg))
    report = build_report(records, samples, rcfg, meta)
    write_report(report, Path(args.out))
    print((Path(args.out) / "report.md").read_text())
    return 0 if report["summary"]["failed"] == 0 else 1
