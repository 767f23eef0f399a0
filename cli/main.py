"""The ``kvrelay`` command line: model, bench, serve, generate here; operator
commands in cli/admin.py, the WAN emulation's in cli/cities.py. Arguments
and environment are read in these modules only; everything below them
receives typed values."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import grpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

from benchmarks import telemetry_bench
from benchmarks.engine_bench import format_result, run_engine_bench, to_json
from benchmarks.kv_bench import format_kv, kv_json, machine, run_kv_bench
from benchmarks.kv_wan import add_wan
from benchmarks.placement_bench import format_placement, run_placement_bench
from benchmarks.tls_bench import format_tls, run_tls_bench
from benchmarks.traces import TraceError, load_trace
from cli import admin as cli_admin
from cli import audit as cli_audit
from cli import bench_hardening
from cli import chaos as cli_chaos
from cli import cities as cli_cities
from cli import governance as cli_governance
from cli import jobs as cli_jobs
from cli import pki as cli_pki
from cli import sim as cli_sim
from cli import trace as cli_trace
from cli import usage as cli_usage
from cli.chaos import run_chaos
from cli.cities import cities_flag, cities_for
from cli.common import (
    add_connect_flags,
    client_dialer,
    default_cache_dir,
    default_token_file,
    grpc_error,
    resolve_model,
    run_replay,
    write_secret,
)
from engine.config import EngineConfig
from engine.default_model import prepare_default_model
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny import write_tiny_checkpoint
from kvtransfer.protection import Protection
from launch.cities import CitiesError, check_privileges
from launch.credentials import (
    CLIENT_TOKEN,
    LOCAL_TENANT,
    ensure_client_token,
    ensure_local_ca,
)
from launch.local import LocalCluster
from launch.ray_backend import RayBackend
from router.auth import token_sha256
from runtime.config import ClusterConfig, ConfigError, load_config
from runtime.tenants import TenantSection


def cmd_model_prepare(args: argparse.Namespace) -> int:

    print(prepare_default_model(args.cache_dir))
    return 0


def cmd_model_tiny(args: argparse.Namespace) -> int:

    print(write_tiny_checkpoint(Path(args.out), args.arch, seed=args.seed))
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:

    path = resolve_model(args.model, args.cache_dir)
    batches = tuple(int(b) for b in args.batches.split(","))
    for dtype in args.dtype.split(","):
        r = run_engine_bench(path, dtype=dtype, threads=args.threads, batches=batches,
                             new_tokens=args.new_tokens, repeat=args.repeat, with_hf=not args.no_reference)
        print(format_result(r), flush=True)
        if args.json:
            Path(args.json).with_suffix(f".{dtype}.json").write_text(to_json(r))
    return 0


def cmd_bench_kv(args: argparse.Namespace) -> int:

    streams = [int(s) for s in args.streams.split(",")]
    if args.wan:
        try:
            check_privileges()  # before the loopback runs, not after them
        except CitiesError as exc:
            raise SystemExit(f"kvrelay bench kv --wan: {exc}") from None
    modes = args.modes.split(",")
    try:
        modes = [Protection.parse(m) for m in modes]
    except ValueError as exc:
        raise SystemExit(f"kvrelay bench kv --modes: {exc}") from None
    model = None if args.no_overlap else resolve_model(args.model, args.cache_dir)
    res = run_kv_bench([int(m) for m in args.sizes.split(",")], streams, args.repeat, model, modes)
    if args.wan:
        add_wan(res)
    print(format_kv(res))
    if args.json:
        command = "kvrelay bench kv " + " ".join(sys.argv[3:])
        Path(args.json).write_text(json.dumps(kv_json(res, command), indent=1) + "\n")
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
                        args.rtt_calls)
    print(format_tls(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=2) + "\n")
    return 0


def cmd_bench_telemetry(args: argparse.Namespace) -> int:
    """Tracing at sample ratio 1.0 against telemetry off: TTFT and decode tokens/s."""
    if args.requests < 2:
        raise SystemExit("kvrelay bench telemetry: --requests must be >= 2")
    cfg = telemetry_bench.TelemetryConfig(requests=args.requests, seed=args.seed)
    report = telemetry_bench.run_telemetry_bench(str(resolve_model(args.model, args.cache_dir)), cfg)
    print(telemetry_bench.format_telemetry(report))
    if args.json:
        out = report | {"command": "kvrelay bench telemetry " + " ".join(sys.argv[3:])}
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
        return run_replay(args, reqs, cluster.start(), cluster)
    finally:
        cluster.stop()


def cmd_generate_local(args: argparse.Namespace) -> int:
    """Runs the engine in this process (no cluster) and streams the answer."""

    path = resolve_model(args.model, args.cache_dir)
    eng = LLMEngine(EngineConfig(model_path=path, dtype=args.dtype))
    ids = eng.tokenizer.encode_prompt(args.prompt, raw=args.raw)
    eng.add_request("cli", ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                               seed=args.seed))
    while eng.has_unfinished():
        for out in eng.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


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
    if cfg.router.jobs_db is None:  # batch jobs, the audit log and usage outlive this run
        cfg.router.jobs_db = str(args.cache_dir / "jobs.sqlite")
    if cfg.router.audit_log is None:
        cfg.router.audit_log = str(args.cache_dir / "audit.jsonl")
    if cfg.router.usage_db is None:
        cfg.router.usage_db = str(args.cache_dir / "usage.sqlite")
    model_path = resolve_model(cfg.model.path, args.cache_dir)
    backend = None
    if args.backend == "ray":
        if args.cities:
            raise ValueError("--cities runs workers in this machine's namespaces; it cannot be combined with "
                             "--backend ray")

        if args.ray_address and os.environ.get("RAY_USE_TLS", "0") not in ("1", "true"):
            print("kvrelay: warning: Ray's TLS is off (RAY_USE_TLS): the launcher hands each worker on another "
                  "node its certificate key and the KV secret through Ray's control channel, which then "
                  "crosses the network in clear (README: Two Ray nodes)", file=sys.stderr)
        backend = RayBackend([s.name for s in cfg.sites], args.ray_address)
    cluster = LocalCluster(cfg, model_path, log_level=args.log_level, cities=cities_for(args), backend=backend)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        addr = cluster.start()
        n = len(cluster.children) - 1
        if cluster.operator_token:
            write_secret(args.token_file, cluster.operator_token)
            print(f"kvrelay: operator token for this run in {args.token_file} (kvrelay scale / drain read it)")
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
        while not stop:
            if any(c.name == "router" for c in cluster.dead_children()):
                print("kvrelay: the router exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        cluster.stop()
        print("kvrelay: stopped", flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    """Streams an answer from a running cluster."""


    req = ipb.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, raw_prompt=args.raw,
                              allowed_jurisdictions=args.jurisdiction or [])
    req.sampling.temperature = args.temperature
    if args.seed is not None:
        req.sampling.seed = args.seed
    finish = None
    with client_dialer(args).sync(args.router) as ch:
        try:
            for msg in igrpc.InferenceStub(ch).Generate(req, timeout=args.timeout):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.HasField("finish"):
                    finish = msg.finish
        except grpc.RpcError as exc:
            sys.stdout.write("\n")
            return grpc_error(exc)
    sys.stdout.write("\n")
    if args.verbose and finish is not None:
        pl = finish.placement
        print(f"[{finish.usage.prompt_tokens} prompt + {finish.usage.completion_tokens} tokens; "
              f"prefill {pl.prefill_worker}, decode {pl.decode_worker}, ttft {pl.ttft_ms:.0f} ms, "
              f"kv {pl.kv_bytes} bytes]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay", description="Disaggregated, multi-site LLM inference.")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where prepared models live (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)
    _add_model_parsers(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    _add_serve_parser(sub)
    _add_generate_parser(sub)
    cli_admin.add_parsers(sub)
    cli_pki.add_parsers(sub)
    cli_jobs.add_parsers(sub)
    cli_usage.add_parsers(sub)
    cli_governance.add_parsers(sub)
    cli_audit.add_parsers(sub)
    cli_trace.add_parsers(sub)
    cli_sim.add_parsers(sub)
    _add_bench_parsers(bench)
    cli_cities.add_parsers(sub, bench)
    _add_generate_local_parser(sub)
    return p


def _add_model_parsers(sub) -> None:
    model = sub.add_parser("model", help="prepare or generate model checkpoints").add_subparsers(
        dest="model_command", required=True)
    prep = model.add_parser("prepare", help="convert the embedded SmolLM2-135M-Instruct once; print its folder")
    prep.set_defaults(func=cmd_model_prepare)
    tiny = model.add_parser("tiny", help="write a small seeded random checkpoint (tests)")
    tiny.add_argument("--arch", default="llama", choices=["llama", "llama3", "qwen2", "mistral"])
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_model_tiny)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="run the cluster (router + workers) in the foreground")
    serve.add_argument("--config", help="cluster config YAML (default: one site, one prefill + one decode worker, "
                                        "the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--port", type=int, help="router port (overrides the config; 0 = any free port)")
    serve.add_argument("--log-level", default="WARNING")
    serve.add_argument("--backend", choices=["local", "ray"], default="local",
                       help="where workers run: processes here, or Ray actors on each site's nodes")
    serve.add_argument("--ray-address", help="existing Ray cluster (default: start a local one)")
    serve.add_argument("--token-file", type=Path, default=default_token_file(),
                       help="where to write this run's operator token (default: %(default)s)")
    cities_flag(serve)
    serve.set_defaults(func=cmd_serve)


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="stream an answer from a running cluster")
    g.add_argument("prompt")
    add_connect_flags(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    g.add_argument("--jurisdiction", action="append", help="allowed jurisdiction (repeatable)")
    g.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    g.add_argument("-v", "--verbose", action="store_true", help="print usage and placement")
    g.set_defaults(func=cmd_generate)


def _add_bench_parsers(bench) -> None:
    """bench engine, kv, placement and replay (bench cities comes with the cities commands)."""
    be = bench.add_parser("engine", help="engine vs transformers: prefill and decode throughput")
    be.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    be.add_argument("--dtype", default="float32", help="comma-separated dtypes (float32, bfloat16)")
    be.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    be.add_argument("--batches", default="1,8,32")
    be.add_argument("--new-tokens", type=int, default=64)
    be.add_argument("--repeat", type=int, default=3)
    be.add_argument("--no-reference", action="store_true", help="skip transformers")
    be.add_argument("--json", help="also write results to this path (.<dtype>.json)")
    be.set_defaults(func=cmd_bench_engine)

    bk = bench.add_parser("kv", help="KV transfer throughput vs raw sockets and memcpy; layer-wise overlap")
    bk.add_argument("--sizes", default="1,16,256", help="MiB of KV per transfer, comma-separated")
    bk.add_argument("--streams", default="1,4")
    bk.add_argument("--modes", default="aead,integrity", help="protections to measure, comma-separated")
    bk.add_argument("--json", help="write the results (one record per size, streams and mode) to this file")
    bk.add_argument("--wan", action="store_true", help="also over an emulated 1 Gbit/s, 60 ms link (root: kvrelay cities)")
    bk.add_argument("--repeat", type=int, default=3)
    bk.add_argument("--model", help="checkpoint for the overlap measurement (default: the embedded model)")
    bk.add_argument("--no-overlap", action="store_true", help="skip the 4k-token layer-wise overlap run")
    bk.set_defaults(func=cmd_bench_kv)

    bp = bench.add_parser("placement", help="placement decision and prefix-index lookup time")
    bp.add_argument("--workers", default="1000", help="worker counts, comma-separated (e.g. 1000,10000)")
    bp.add_argument("--sites", type=int, default=10)
    bp.add_argument("--prompt-tokens", type=int, default=8192)
    bp.add_argument("--decisions", type=int, default=500)
    bp.add_argument("--json", help="also write p50/p99 of hashing, lookup, place and their sum to this file")
    bp.set_defaults(func=cmd_bench_placement)
    _add_replay_parser(bench)
    bench_hardening.add_parsers(bench)
    bte = bench.add_parser("telemetry", help="TTFT and decode tokens/s with every request traced vs telemetry off")
    bte.add_argument("--requests", type=int, default=24, help="measured requests per cluster (after 2 warm-up)")
    bte.add_argument("--seed", type=int, default=0)
    bte.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    bte.add_argument("--json", help="also write the report to this file")
    bte.set_defaults(func=cmd_bench_telemetry)

    bt = bench.add_parser("tls", help="TTFT and gRPC round trip with TLS against the same build with TLS off")
    bt.add_argument("--config", help="cluster of both runs (default: the embedded default)")
    bt.add_argument("--prompt-tokens", type=int, default=256)
    bt.add_argument("--requests", type=int, default=40, help="measured requests per cluster (after 4 warm-up)")
    bt.add_argument("--rtt-calls", type=int, default=400, help="unary calls per cluster for the round trip")
    bt.add_argument("--json", help="also write the result to this file")
    bt.set_defaults(func=cmd_bench_tls)


def _add_replay_parser(bench) -> None:
    br = bench.add_parser("replay", help="replay a request trace (Azure CSV or Mooncake JSONL) and report")
    br.add_argument("--trace", required=True, type=Path, help="trace file")
    br.add_argument("--format", choices=["azure", "mooncake"], help="default: from the file's first line")
    br.add_argument("--config", help="cluster to start (default: the embedded default); ignored with --router")
    add_connect_flags(br, router_default=None)
    br.add_argument("--limit", type=int, help="first N requests of the trace")
    br.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    br.add_argument("--length-scale", type=float, help="multiply every input and output length by this")
    br.add_argument("--output-scale", type=float, help="multiply output lengths by this instead")
    br.add_argument("--slo-ttft", type=float, help="TTFT objective in seconds (for goodput)")
    br.add_argument("--slo-tpot", type=float, help="TPOT objective in seconds (for goodput)")
    br.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    br.add_argument("--warmup", type=int, default=0,
                    help="send the first N prompts (4 tokens each) one at a time before the replay; not reported")
    br.add_argument("--no-progress", action="store_true")
    br.add_argument("--out", required=True, help="directory for report.json and report.md")
    cities_flag(br)
    cli_chaos.add_flags(br)
    br.set_defaults(func=cmd_bench_replay)


def _add_generate_local_parser(sub) -> None:
    gen = sub.add_parser("generate-local", help="generate with an in-process engine (no cluster)")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.set_defaults(func=cmd_generate_local)


def main(argv: list[str] | None = None) -> int:

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (EngineError, ValueError, OSError, RuntimeError) as exc:
        print(f"kvrelay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
