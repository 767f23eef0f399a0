"""The `kvrelay` commands that run a cluster, or no model, in this process: model
prepare, serve, demo, bench (placement, tls, handshakes, replay, cities,
link-track, routers). cli/main.py reaches these functions through cli/lazy.py,
only when their command runs; they import no torch (the commands that run it
here are in cli/compute.py), so that serve or a refused argument starts in
about a second, not six."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from kvrelay.benchmarks import cities_bench as cb
from kvrelay.benchmarks import link_track, routers_bench
from kvrelay.benchmarks.handshake_bench import format_handshakes, run_handshake_bench
from kvrelay.benchmarks.machine import machine
from kvrelay.benchmarks.placement_bench import format_placement, run_placement_bench
from kvrelay.benchmarks.replay import trace_slice
from kvrelay.benchmarks.tls_bench import format_tls, run_tls_bench
from kvrelay.benchmarks.traces import SAMPLE_AZURE, TraceError, build_prompts, load_trace
from kvrelay.cli.chaos import run_chaos
from kvrelay.cli.cities import cities_for
from kvrelay.cli.common import write_secret
from kvrelay.cli.replay_run import VOCAB_RANGE, replay_config, run_replay
from kvrelay.engine.default_model import prepare_default_model
from kvrelay.launch import cities
from kvrelay.launch.cities import check_privileges
from kvrelay.launch.credentials import (
    CLIENT_TOKEN,
    LOCAL_TENANT,
    ensure_client_token,
    ensure_local_ca,
)
from kvrelay.launch.local import LocalCluster
from kvrelay.launch.ray_backend import RayBackend, RayPlaintext
from kvrelay.router.core.auth import token_sha256
from kvrelay.runtime.config import ClusterConfig, ConfigError, load_config
from kvrelay.runtime.tenants import TenantSection


def resolve_model(arg: str | None, cache_dir: Path) -> Path:
    """``arg``'s folder, else the embedded default model (converted on first use)."""
    return Path(arg) if arg else prepare_default_model(cache_dir)


def cmd_model_prepare(args: argparse.Namespace) -> int:
    print(prepare_default_model(args.cache_dir))
    return 0


def cmd_bench_placement(args: argparse.Namespace) -> int:
    try:
        sizes = [int(n) for n in args.workers.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2 or args.sites < 1 or args.decisions < 1 or args.prompt_tokens < 16:
        print("kvrelay: --workers takes comma-separated counts >= 2 (e.g. 1000,10000); --sites and --decisions "
              ">= 1, --prompt-tokens >= 16", file=sys.stderr)
        return 2
    results = []
    for n in sizes:
        res = run_placement_bench(n, args.sites, args.prompt_tokens, args.decisions)
        print(format_placement(res) + "\n")
        results.append(res.to_json())
    if args.json:
        out = {"command": "kvrelay bench placement " + " ".join(sys.argv[3:]), "machine": machine(),
               "results": results}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def cmd_bench_tls(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    res = run_tls_bench(cfg, resolve_model(cfg.model.path, args.cache_dir), args.prompt_tokens, args.requests,
                        args.rtt_calls, checked=args.checked)
    print(format_tls(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=2) + "\n")
    return 0


def cmd_bench_handshakes(args: argparse.Namespace) -> int:
    """Renewable listeners' handshakes against static ones (benchmarks/handshake_bench.py)."""
    try:
        res = run_handshake_bench(args.connections, args.renew_every)
    except ValueError as exc:
        raise SystemExit(f"kvrelay bench handshakes: {exc}") from None
    print(format_handshakes(res))
    if args.json:
        out = {"command": "kvrelay bench handshakes " + " ".join(sys.argv[3:]), "machine": machine(), **res.to_dict()}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def cmd_bench_replay(args: argparse.Namespace) -> int:
    if args.speedup <= 0 or any(x is not None and x <= 0 for x in (args.length_scale, args.output_scale)) \
            or args.warmup < 0:
        print("kvrelay: --speedup, --length-scale and --output-scale must be positive, --warmup >= 0",
              file=sys.stderr)
        return 2
    try:
        reqs = load_trace(args.trace, args.format, args.limit)
    except TraceError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    if args.chaos is not None and (args.router is not None or args.chaos <= 0):
        print("kvrelay: --chaos needs a positive rate, and a cluster of its own (not --router)", file=sys.stderr)
        return 2
    if args.router is not None:
        return run_replay(args, reqs, args.router, None)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    cfg.router.port = 0
    if args.chaos is not None:

        return run_chaos(args, reqs, cfg, resolve_model(cfg.model.path, args.cache_dir), cities_for(args))
    cluster = LocalCluster(cfg, resolve_model(cfg.model.path, args.cache_dir), cities=cities_for(args))
    try:
        cluster.start()
        return run_replay(args, reqs, cluster.addresses, cluster)  # several routers: each in turn
    finally:
        cluster.stop()


def local_defaults(cfg: ClusterConfig, cache_dir: Path) -> None:
    """Zero setup: a config that names no CA uses the per-user one under the
    cache folder, and one that lists no clients (and allows no anonymous
    ones) gets the per-user client token there, as tenant ``local``; both are
    made on first use and found by every other command."""
    if cfg.tls.enabled and cfg.tls.ca is None:
        cfg.tls.ca, cfg.tls.ca_key = (str(p) for p in ensure_local_ca(cache_dir))
    if not cfg.tenants and not cfg.auth.allow_anonymous:
        cfg.tenants.append(TenantSection(LOCAL_TENANT, token_sha256(ensure_client_token(cache_dir))))


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs the cluster in the foreground until Ctrl-C / SIGTERM."""
    cfg = load_config(args.config)
    if args.port is not None:
        cfg.router.port = args.port
    local_defaults(cfg, args.cache_dir)
    if cfg.router.records.jobs_db is None:  # batch jobs, the audit log and usage outlive this run
        cfg.router.records.jobs_db = str(args.cache_dir / "jobs.sqlite")
    if cfg.router.records.audit_log is None:
        cfg.router.records.audit_log = str(args.cache_dir / "audit.jsonl")
    if cfg.router.records.usage_db is None:
        cfg.router.records.usage_db = str(args.cache_dir / "usage.sqlite")
    model_path = resolve_model(cfg.model.path, args.cache_dir)
    try:
        backend = _serve_backend(cfg, args)
    except RayPlaintext as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    cluster = LocalCluster(cfg, model_path, log_level=args.log_level, cities=cities_for(args), backend=backend,
                           config_file=args.config)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        cluster.start()
        _announce(cluster, args, model_path)
        reported: set[str] = set()
        while not stop:
            if _routers_gone(cluster, reported):
                return 1
            time.sleep(0.5)
        return 0
    finally:
        cluster.stop()
        print("kvrelay: stopped", flush=True)


def _serve_backend(cfg: ClusterConfig, args: argparse.Namespace) -> RayBackend | None:
    """Where `kvrelay serve`'s workers run (None: processes here); ValueError for flags that do not combine."""
    if args.backend != "ray":
        return None
    if args.cities:
        raise ValueError("--cities runs workers in this machine's namespaces; it cannot be combined with "
                         "--backend ray")
    ray_tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    # without Ray's TLS, refused unless every node is this machine (secrets travel with the actors)
    return RayBackend([s.name for s in cfg.sites], args.ray_address, ray_tls=ray_tls)


def _announce(cluster: LocalCluster, args: argparse.Namespace, model_path: Path) -> None:
    """What `kvrelay serve` prints once serving: where, with what, and how to try it."""
    cfg = cluster.cfg
    addr, n = cluster.router_address, len(cluster.children) - len(cluster.routers)
    if cluster.operator_token:
        write_secret(args.token_file, cluster.operator_token)
        print(f"kvrelay: operator token for this run in {args.token_file} (kvrelay scale / drain read it)")
    if cfg.routers:
        addr = ",".join(r.address for r in cluster.routers.values())
        for entry in cfg.routers:
            ready = cluster.routers[entry.name]
            print(f"kvrelay: router {entry.name} at {entry.site} on {ready.address}"
                  + (f" (HTTP {ready.http})" if ready.http else ""), flush=True)
        print(f"kvrelay: etcd at {', '.join(cfg.etcd.endpoints)}", flush=True)
        print(f"kvrelay: batch jobs in PostgreSQL at {', '.join(cfg.postgres.endpoints)} (primary, then standbys)",
              flush=True)
    print(f"kvrelay: serving {model_path.name} on {addr} with {n} workers ({args.backend}) "
          f"(try: kvrelay generate --router {addr} \"What is the capital of France?\")", flush=True)
    if cluster.http_address:
        scheme = "https" if cfg.tls.enabled else "http"
        print(f"kvrelay: OpenAI-compatible HTTP API on {scheme}://{cluster.http_address}/v1", flush=True)
    if cluster.metrics_address:
        print(f"kvrelay: Prometheus metrics on http://{cluster.metrics_address}/metrics "
              "(workers' in kvrelay status)", flush=True)
    if cfg.tls.enabled:
        print(f"kvrelay: TLS by the CA in {cfg.tls.ca}; tenant token of this machine's user in "
              f"{args.cache_dir / CLIENT_TOKEN} (the kvrelay commands find both)", flush=True)


def _routers_gone(cluster: LocalCluster, reported: set[str]) -> bool:
    """Says once which routers exited (``reported``: those said); True when none is left (the run stops)."""
    routers = [c for c in cluster.children if c.name.startswith("router")]
    dead = [c for c in routers if c.proc.poll() is not None]
    for c in dead:
        if c.name not in reported:
            reported.add(c.name)
            left = len(routers) - len(dead)
            print(f"kvrelay: {c.name} exited" + (f"; {left} router(s) serve on" if left else "; stopping"),
                  file=sys.stderr)
    return bool(routers) and len(dead) == len(routers)


CODEC_FLAGS = {"link_mbps": 200.0, "link_rtt_ms": 30.0, "prompt_tokens": "2000-8000", "gap_s": 20.0}
"""``kvrelay bench cities --codecs``'s own flags and their defaults."""


def _codec_flags(args: argparse.Namespace) -> tuple[int, int] | None:
    """The --codecs flags checked (defaults filled in on ``args``) and the prompt-length range; None without
    --codecs, where any of them is refused rather than ignored."""
    given = [f"--{name.replace('_', '-')}" for name in CODEC_FLAGS if getattr(args, name) is not None]
    if not args.codecs:
        if given:
            raise ValueError(f"{', '.join(given)}: only with --codecs")
        return None
    for name, default in CODEC_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    lo, _, hi = args.prompt_tokens.partition("-")
    if not (lo.isdigit() and (hi or lo).isdigit() and 0 < int(lo) <= int(hi or lo)):
        raise ValueError(f"--prompt-tokens {args.prompt_tokens!r}: expected LO-HI, two token counts, 0 < LO <= HI")
    if args.link_mbps <= 0 or args.link_rtt_ms < 0 or args.gap_s < 0:
        raise ValueError("--link-mbps must be positive, --link-rtt-ms and --gap-s at least 0")
    return int(lo), int(hi or lo)


def cmd_bench_cities(args: argparse.Namespace) -> int:
    span = _codec_flags(args)
    if args.speedup <= 0 or args.length_scale <= 0 or args.limit < 1:
        print("kvrelay: --speedup and --length-scale must be positive, --limit at least 1", file=sys.stderr)
        return 2
    args.trace = args.trace or SAMPLE_AZURE
    try:
        cities.check_privileges()
        emulate = True
    except cities.CitiesError as exc:
        print(f"kvrelay: no WAN emulation ({exc}); the links exist only in placement's figures", file=sys.stderr)
        emulate = False
    example = cb.load_example()
    every = cb.codec_scenarios(example, args.link_mbps, args.link_rtt_ms) if span else cb.scenarios(example)
    chosen = [sc for sc in every if not args.only or sc.name in args.only.split(",")]
    if not chosen:
        raise ValueError(f"--only {args.only!r} names no scenario ({', '.join(sc.name for sc in every)})")
    if span is None:
        reqs = load_trace(args.trace, args.format, args.limit)
    else:
        reqs = cb.long_slice(load_trace(args.trace, args.format), args.length_scale, *span, args.limit, args.gap_s)
        if not reqs:
            raise ValueError(f"--prompt-tokens {args.prompt_tokens}: no request of the trace has such a prompt "
                             f"at --length-scale {args.length_scale:g}")
    prompts = build_prompts(reqs, args.length_scale, VOCAB_RANGE, seed=args.seed)
    rcfg = replay_config(args)
    model_path = resolve_model(example.get("model", {}).get("path"), args.cache_dir)
    out = Path(args.out)
    meta = {"trace": str(args.trace), "limit": args.limit, "speedup": args.speedup,
            "length_scale": args.length_scale, "seed": args.seed, "wan_emulation": emulate,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "trace_slice": trace_slice(reqs),
            "scale_reason": f"--length-scale {args.length_scale:g}", "format": args.format or "auto",
            "codecs": span is not None and {name: getattr(args, name) for name in CODEC_FLAGS}}
    rows = []
    for sc in chosen:
        print(f"kvrelay: scenario {sc.name}: {sc.what}", flush=True)
        report = cb.run_scenario(sc, model_path, prompts, rcfg, emulate, out, meta)
        rows.append(cb.summary_row(sc.name, sc.what, report))
    print(cb.write_summary(rows, out, meta))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def cmd_bench_link_track(args: argparse.Namespace) -> int:
    """How fast the router's estimate of a link follows its shaped rate (benchmarks/link_track.py)."""
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        raise ValueError(f"--rates {args.rates!r}: expected comma-separated Mbit/s, e.g. 200,50,200") from None
    if not rates or min(rates) <= 0 or args.configured_mbps <= 0 or args.rtt_ms <= 0:
        raise ValueError("--rates, --configured-mbps and --rtt-ms must be positive")
    if args.per_phase < 1 or args.prompt_tokens < 16:
        raise ValueError("--per-phase must be at least 1 and --prompt-tokens at least 16")
    check_privileges()
    meta = {"machine": machine(), "rates_mbps": rates, "per_phase": args.per_phase,
            "prompt_tokens": args.prompt_tokens, "configured_mbps": args.configured_mbps, "rtt_ms": args.rtt_ms,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    phases = link_track.run(resolve_model(None, args.cache_dir), rates, args.per_phase, args.prompt_tokens,
                            args.configured_mbps, args.rtt_ms)
    print(link_track.write(phases, Path(args.out), meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **link_track.summary(phases)}, indent=2))
    return 0


def cmd_bench_routers(args: argparse.Namespace) -> int:
    """One router against three on the same trace slice (benchmarks/routers_bench.py)."""
    if args.limit < 1 or args.start < 0 or not 0 < args.scale <= 1:
        raise ValueError("--limit must be at least 1, --start at least 0 and --scale in (0, 1]")
    report = routers_bench.run(resolve_model(None, args.cache_dir), Path(args.trace), args.start, args.limit,
                               args.scale)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    report["meta"] = {"machine": machine(), "started": started}
    print(routers_bench.markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Three cities (emulated WAN when root), a short trace slice, the summary."""
    example = Path(__file__).resolve().parents[1] / "examples" / "three-cities.yaml"
    if not example.exists():
        raise ValueError(f"{example} is missing: run kvrelay demo from a source checkout")
    cfg = load_config(example)
    cfg.router.port = 0
    out = Path(args.out or tempfile.mkdtemp(prefix="kvrelay-demo-"))
    state_dir = Path(tempfile.mkdtemp(prefix="kvrelay-demo-state-"))
    st = None
    try:
        cities.check_privileges()
        st = cities.up(cfg, state_dir, subnet="10.215.0.0/16", prefix="kvdm")
        print(f"kvrelay demo: Toronto, Montreal and Vancouver in their own namespaces, "
              f"joined by emulated links ({', '.join(f'{lk.a}-{lk.b} {lk.rtt_ms:g} ms' for lk in st.links)})")
    except cities.CitiesError as exc:
        print(f"kvrelay demo: no WAN emulation ({exc}); the three cities share loopback and the links "
              "exist only in placement's figures", file=sys.stderr)
    try:
        reqs = load_trace(SAMPLE_AZURE, "azure", args.requests)
        cluster = LocalCluster(cfg, resolve_model(cfg.model.path, args.cache_dir), cities=st)
        try:
            address = cluster.start()
            print(f"kvrelay demo: cluster up (router {address}); replaying {len(reqs)} requests of the Azure "
                  f"code trace at 1/10 of their lengths", flush=True)
            replay_args = argparse.Namespace(trace=SAMPLE_AZURE, format="azure", limit=args.requests,
                                             speedup=1.0, length_scale=0.1, slo_ttft=args.slo_ttft,
                                             slo_tpot=args.slo_tpot, seed=0, no_progress=False, out=out)
            rc = run_replay(replay_args, reqs, address, cluster)
        finally:
            cluster.stop()
    finally:
        if st is not None:
            cities.down(state_dir)
    print(f"kvrelay demo: the full report (report.json, report.md, plots) is in {out}")
    return rc


