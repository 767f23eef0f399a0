"""What `kvrelay bench replay`, `bench cities`, `demo` and the chaos run
share: the prompts of a trace checked against the served model, and one
replay against a router with its report."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from pathlib import Path

import grpc

from kvrelay.benchmarks.replay import (
    ReplayConfig,
    build_report,
    check_lengths,
    replay,
    trace_slice,
    write_report,
)
from kvrelay.benchmarks.traces import build_prompts
from kvrelay.cli.common import (
    client_dialer,
    default_token_file,
    dialer,
    grpc_error,
    operator_token,
)
from kvrelay.runtime.rpc import Dialer
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

VOCAB_RANGE = (100, 10000)
"""Token ids of replayed prompts: inside any real vocabulary, clear of special tokens."""


def replay_config(args: argparse.Namespace):
    """The replay settings given on the command line."""

    return ReplayConfig(speedup=args.speedup, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                        progress=not args.no_progress, warmup=getattr(args, "warmup", 0))


def replay_prompts(args: argparse.Namespace, reqs, address: str, client: Dialer) -> tuple[list, dict] | int:
    """The prompts to replay, their lengths checked against the model the
    router at ``address`` serves, and the report's metadata; an exit code
    (after saying why) when they cannot be replayed."""
    with client.sync(address.split(",")[0]) as ch:  # several routers: they serve the same model
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
    return {"router": address, "policy": cluster.cfg.router.placement.policy if cluster is not None else "?",
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "wan_emulation": cluster is not None and cluster.cities is not None,
            "config": cluster.cfg.to_dict() if cluster is not None else None, "trace_slice": trace_slice(reqs)}


def run_replay(args: argparse.Namespace, reqs, address: str, cluster) -> int:
    """Replays ``reqs`` against the router at ``address``; writes and prints the report."""
    if cluster is not None:
        client, operator = cluster.client_dialer, cluster.operator_dialer
    else:
        client, operator = client_dialer(args), dialer(args, operator_token(default_token_file()))
    got = replay_prompts(args, reqs, address, client)
    if isinstance(got, int):
        return got
    prompts, meta = got
    rcfg = replay_config(args)
    meta |= run_meta(reqs, address, cluster)
    records, samples = asyncio.run(replay(address, prompts, rcfg, client, operator))
    report = build_report(records, samples, rcfg, meta)
    write_report(report, Path(args.out))
    print((Path(args.out) / "report.md").read_text())
    return 0 if report["summary"]["failed"] == 0 else 1
