"""`kvrelay sim`, `kvrelay profile` and `kvrelay plan capacity`: capacity
planning on a simulated deployment that runs kvrelay's own placement."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

from kvrelay.benchmarks.replay import trace_slice, write_report
from kvrelay.benchmarks.sim.cluster import Failure, RateChange, SimConfig, SimInputError
from kvrelay.benchmarks.sim.planner import Plan, PlanGoal, Planner, Shape
from kvrelay.benchmarks.sim.profile import ProfileError, load_profile
from kvrelay.benchmarks.sim.run import Objectives, simulate
from kvrelay.benchmarks.sim.workload import arrivals
from kvrelay.benchmarks.traces import TraceError, load_trace
from kvrelay.cli.lazy import compute
from kvrelay.runtime.config import ConfigError, load_config

_FAIL = re.compile(r"^(worker|link):(?P<target>[^@]+)@(?P<at>[0-9.]+)(\+(?P<for>[0-9.]+))?$")


def parse_failure(text: str) -> Failure:
    """``worker:ID@T`` or ``link:A-B@T[+SECONDS]`` (times in seconds of simulated time)."""
    m = _FAIL.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"--fail {text!r}: expected worker:ID@SECONDS or link:A-B@SECONDS[+SECONDS]")
    return Failure(text.split(":", 1)[0], m["target"], float(m["at"]), float(m["for"]) if m["for"] else None)


_RATE = re.compile(r"^(?P<link>[^@]+)@(?P<at>[0-9.]+)=(?P<gbps>[0-9.]+)$")


def parse_rate_change(text: str) -> RateChange:
    """``A-B@T=GBPS``: link A-B runs at GBPS Gbit/s from T seconds of simulated time on."""
    m = _RATE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"--link-rate {text!r}: expected A-B@SECONDS=GBPS")
    try:
        return RateChange(m["link"], float(m["at"]), float(m["gbps"]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--link-rate {text!r}: SECONDS and GBPS must be numbers") from None


def routers_arg(text: str) -> str:
    """``--routers``: a positive count, or ``sites``."""
    if text != "sites" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"--routers {text!r}: expected a count >= 1 or 'sites'")
    return text


def sim_inputs(args: argparse.Namespace):
    """(config, profile, arrivals, report meta) from the command line; raises ValueError naming the problem."""
    for name in ("speedup", "length_scale", "output_scale"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.repeat < 1:
        raise ValueError("--repeat must be at least 1")
    if args.router_ms < 0 or args.rpc_ms < 0:
        raise ValueError("--router-ms and --rpc-ms must be >= 0")
    cfg = load_config(args.config)
    profile = load_profile(args.profile)
    reqs = load_trace(args.trace, args.format, args.limit)
    scale = args.length_scale or 1.0
    arr = arrivals(reqs, scale, args.output_scale, args.speedup, args.repeat)
    if args.limit is not None:
        arr = arr[:args.limit]
    meta = {"trace": str(args.trace), "format": args.format or "auto", "limit": args.limit, "speedup": args.speedup,
            "length_scale": scale, "output_scale": args.output_scale, "repeat": args.repeat,
            "scale_reason": f"--length-scale {scale:g} given" if args.length_scale else "",
            "seed": args.seed, "model": profile.model.name, "context_window": profile.model.max_context,
            "config": cfg.to_dict(), "trace_slice": trace_slice(reqs[:1000]),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    return cfg, profile, arr, meta


def cmd_sim(args: argparse.Namespace) -> int:
    try:
        cfg, profile, arr, meta = sim_inputs(args)
    except (ValueError, TraceError, ConfigError, ProfileError) as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    routers = len(cfg.sites) if args.routers == "sites" else int(args.routers)
    sim = SimConfig(seed=args.seed, router_s=args.router_ms / 1e3, rpc_s=args.rpc_ms / 1e3, failures=args.fail,
                    rate_changes=args.link_rate, routers=routers, heartbeat_s=args.heartbeat_s)
    try:
        report = simulate(cfg, profile, arr, sim, Objectives(args.slo_ttft, args.slo_tpot), meta)
    except SimInputError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    write_report(report, out, plots=not args.no_plots)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": {k: v for k, v in report["meta"].items()
                                                        if k not in ("config", "trace_slice")},
                                               "summary": report["summary"]}, indent=1, default=str) + "\n")
    print((out / "report.md").read_text())
    return 0


def _add_trace_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="the deployment, as `kvrelay serve --config` (default: the embedded default)")
    p.add_argument("--trace", required=True, type=Path, help="Azure CSV or Mooncake JSONL trace")
    p.add_argument("--format", choices=["azure", "mooncake"], help="default: from the file's first line")
    p.add_argument("--limit", type=int, help="first N requests (of the repeated trace)")
    p.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    p.add_argument("--repeat", type=int, default=1, help="play the trace this many times, one after the other")
    p.add_argument("--length-scale", type=float, help="multiply every input and output length by this")
    p.add_argument("--output-scale", type=float, help="multiply output lengths by this instead")
    p.add_argument("--profile", required=True,
                   help="a file from `kvrelay profile`, or GPU:MODEL[:DTYPE], e.g. h100:llama-3.1-8b:fp8")
    p.add_argument("--seed", type=int, default=0, help="seed of placement's tie-breaking")
    p.add_argument("--router-ms", type=float, default=2.0, help="router time per request before placement")
    p.add_argument("--rpc-ms", type=float, default=0.5, help="one internal RPC or streamed message")


def add_parsers(sub) -> None:
    s = sub.add_parser("sim", help="simulate a deployment (same config as serve) on a trace; report as bench replay")
    _add_trace_flags(s)
    s.add_argument("--slo-ttft", type=float, help="TTFT objective in seconds (for goodput)")
    s.add_argument("--slo-tpot", type=float, help="TPOT objective in seconds (for goodput)")
    s.add_argument("--fail", action="append", default=[], type=parse_failure,
                   help="worker:ID@SECONDS or link:A-B@SECONDS[+SECONDS] (repeatable)")
    s.add_argument("--link-rate", action="append", default=[], type=parse_rate_change,
                   help="A-B@SECONDS=GBPS: the link's rate changes then (repeatable); the router measures it "
                        "from its transfers (router.placement.link_rates)")
    s.add_argument("--routers", default="1", type=routers_arg,
                   help="routers placing at once, each counting only its own requests in flight: N, or 'sites' "
                        "(one per site); request i enters at router i mod N")
    s.add_argument("--heartbeat-s", type=float, default=0.0,
                   help="workers' heartbeat interval: how far every router's view of their load and prefix caches "
                        "lags (live: router.liveness.heartbeat_interval_s, 1 s by default; 0: exact views)")
    s.add_argument("--out", required=True, help="directory for report.json and report.md")
    s.add_argument("--json", help="also write meta and summary to this file")
    s.add_argument("--no-plots", action="store_true", help="skip the PNG plots (large runs)")
    s.set_defaults(func=cmd_sim)
    p = sub.add_parser("profile", help="measure an engine's step time on this machine for the simulator")
    p.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--name", help="model name recorded in the profile (default: the folder's name)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads, as each worker uses (default: 1)")
    p.add_argument("--sharing", type=int, default=1,
                   help="engines on the machine while measuring (this one + N-1 neighbours running a worker's load), "
                        "as many as the deployment runs workers here")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median counts)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (tests)")
    p.add_argument("--out", required=True, help="profile file to write (JSON)")
    p.set_defaults(func=compute("cmd_profile"))
    add_plan_parser(sub)
    add_report_parser(sub)


def _plan_text(plan: Plan, goal: PlanGoal) -> str:
    if plan.best is None:
        return f"No recommendation: {plan.reason}.\n"
    b = plan.best
    lines = [f"Recommendation: {b.workers} accelerator(s), {b.shape.value}, meeting "
             f"TTFT <= {goal.slo_ttft_s:g} s and TPOT <= {goal.slo_tpot_s:g} s for {b.attainment:.1%} of requests "
             f"(target {goal.attainment:.0%}); goodput {b.goodput_rps:.2f} req/s, TTFT p90 {b.ttft_p90_ms:.0f} ms, "
             f"TPOT p90 {b.tpot_p90_ms:.1f} ms.", "", "| site | prefill | decode |", "|---|---|---|"]
    lines += [f"| {s} | {p} | {d} |" for s, p, d in b.pools if p or d]
    lines += ["", f"Why this many: {plan.reason}.", "", "One worker fewer:", ""]
    lines += [f"- without one of {label}: attainment {o.attainment:.1%}, TTFT p90 {o.ttft_p90_ms:.0f} ms, "
              f"TPOT p90 {o.tpot_p90_ms:.1f} ms" for label, o in plan.smaller] or ["- (none smaller is possible)"]
    lines += ["", f"{len(plan.tried)} configurations simulated."]
    return "\n".join(lines) + "\n"


def _plan_plot(plan: Plan, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for shape in Shape:
        pts = [(o.workers, o.goodput_rps) for o in plan.tried if o.shape is shape]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(xs, ys, label=shape.value, s=18)
    if plan.best is not None:
        ax.scatter([plan.best.workers], [plan.best.goodput_rps], marker="*", s=160, color="k", label="recommended")
    ax.set(xlabel="accelerators", ylabel="goodput (req/s meeting the SLOs)", title="Cost vs goodput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "cost_goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_plan_capacity(args: argparse.Namespace) -> int:
    try:
        if not 0 < args.attainment <= 1 or args.slo_ttft <= 0 or args.slo_tpot <= 0:
            raise ValueError("--attainment must be in (0, 1], --slo-ttft and --slo-tpot positive")
        cfg, profile, arr, meta = sim_inputs(args)
        sites = args.sites.split(",") if args.sites else None
        unknown = sorted(set(sites or ()) - {s.name for s in cfg.sites})
        if unknown:
            raise ValueError(f"--sites names sites the config lacks: {', '.join(unknown)}")
    except (ValueError, TraceError, ConfigError, ProfileError) as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    goal = PlanGoal(args.slo_ttft, args.slo_tpot, args.attainment, sites)
    sim = SimConfig(seed=args.seed, router_s=args.router_ms / 1e3, rpc_s=args.rpc_ms / 1e3)
    try:
        plan = Planner(cfg, goal, lambda c: simulate(c, profile, arr, sim,
                                                     Objectives(goal.slo_ttft_s, goal.slo_tpot_s), {})).plan()
    except SimInputError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    text = _plan_text(plan, goal)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.md").write_text(text + f"\n![cost_goodput]({_plan_plot(plan, out).name})\n")
        (out / "plan.json").write_text(json.dumps(
            {"goal": asdict(goal), "profile": profile.describe(), "trace": meta["trace"], "requests": len(arr),
             "best": asdict(plan.best) if plan.best else None, "reason": plan.reason,
             "smaller": [{"removed": lbl, **asdict(o)} for lbl, o in plan.smaller],
             "tried": [asdict(o) for o in plan.tried]}, indent=1, default=str) + "\n")
    return 0 if plan.best is not None else 1


def add_plan_parser(sub) -> None:
    """`kvrelay plan capacity`, beside the live `kvrelay plan [--apply]` (cli/admin.py)."""
    plan = sub.choices["plan"].add_subparsers(dest="plan_command", required=False,
                                              title="offline planning (without: the live cluster's recommendation)")
    c = plan.add_parser("capacity", help="fewest accelerators per site meeting the SLO attainment on a trace")
    _add_trace_flags(c)
    c.add_argument("--slo-ttft", type=float, required=True, help="TTFT objective in seconds")
    c.add_argument("--slo-tpot", type=float, required=True, help="TPOT objective in seconds")
    c.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both")
    c.add_argument("--sites", help="comma-separated sites that may get workers (default: every site)")
    c.add_argument("--out", help="directory for plan.md, plan.json and cost_goodput.png")
    c.set_defaults(func=cmd_plan_capacity)


COMPARED = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency"))


def compare_reports(base: dict, other: dict) -> list[tuple[str, str, float, float, float]]:
    """(metric, percentile, base value, other value, relative error of other) for the latency percentiles."""
    rows = []
    for key, name in COMPARED:
        a, b = base["summary"][key], other["summary"][key]
        for q in ("p50", "p90", "p99"):
            if q in a and q in b and a[q]:
                rows.append((name, q, a[q], b[q], (b[q] - a[q]) / a[q]))
    return rows


def cmd_report_compare(args: argparse.Namespace) -> int:
    try:
        base, other = (json.loads(Path(p).read_text()) for p in (args.base, args.other))
        rows = compare_reports(base, other)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        print(f"kvrelay: not two report.json files of bench replay or sim ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    print(f"| metric (ms) | {args.base} | {args.other} | error |\n|---|---|---|---|")
    for name, q, a, b, err in rows:
        print(f"| {name} {q} | {a:.1f} | {b:.1f} | {err:+.1%} |")
    return 0


def add_report_parser(sub) -> None:
    rep = sub.add_parser("report", help="work with report.json files").add_subparsers(dest="report_command",
                                                                                     required=True)
    c = rep.add_parser("compare", help="latency percentiles of two reports (a live replay and a simulation) side "
                                       "by side, with the second's relative error")
    c.add_argument("base", help="report.json taken as the reference (e.g. the live replay)")
    c.add_argument("other", help="report.json compared with it (e.g. the simulation)")
    c.set_defaults(func=cmd_report_compare)
