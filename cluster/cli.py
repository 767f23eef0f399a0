"""The ``kvrelay`` command line. Arguments and environment are read here and
only here; everything below receives typed values."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def default_cache_dir() -> Path:
    """``$KVRELAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrelay``, else ``~/.cache/kvrelay``."""
    if os.environ.get("KVRELAY_CACHE_DIR"):
        return Path(os.environ["KVRELAY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvrelay"


def _resolve_model(arg: str | None, cache_dir: Path) -> Path:
    from engine.default_model import prepare_default_model

    return Path(arg) if arg else prepare_default_model(cache_dir)


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from engine.default_model import prepare_default_model

    print(prepare_default_model(args.cache_dir))
    return 0


def cmd_model_tiny(args: argparse.Namespace) -> int:
    from engine.tiny import write_tiny_checkpoint

    print(write_tiny_checkpoint(Path(args.out), args.arch, seed=args.seed))
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from benchmarks.engine_bench import format_result, run_engine_bench, to_json

    path = _resolve_model(args.model, args.cache_dir)
    batches = tuple(int(b) for b in args.batches.split(","))
    for dtype in args.dtype.split(","):
        r = run_engine_bench(path, dtype=dtype, threads=args.threads, batches=batches,
                             new_tokens=args.new_tokens, repeat=args.repeat, with_hf=not args.no_reference)
        print(format_result(r), flush=True)
        if args.json:
            Path(args.json).with_suffix(f".{dtype}.json").write_text(to_json(r))
    return 0


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from benchmarks.kv_bench import format_kv, run_kv_bench

    streams = [int(s) for s in args.streams.split(",")]
    model = None if args.no_overlap else _resolve_model(args.model, args.cache_dir)
    res = run_kv_bench([int(m) for m in args.sizes.split(",")], streams, args.repeat, model)
    print(format_kv(res, streams))
    return 0


def cmd_bench_placement(args: argparse.Namespace) -> int:
    from benchmarks.placement_bench import format_placement, run_placement_bench

    print(format_placement(run_placement_bench(args.workers, args.sites, args.prompt_tokens, args.decisions)))
    return 0


VOCAB_RANGE = (100, 10000)
"""Token ids of replayed prompts: inside any real vocabulary, clear of special tokens."""


def cmd_bench_replay(args: argparse.Namespace) -> int:
    import asyncio
    import datetime

    import grpc

    from benchmarks.replay import ReplayConfig, build_report, check_lengths, replay, write_report
    from benchmarks.traces import TraceError, build_prompts, load_trace
    from cluster.config import ConfigError, load_config
    from cluster.launch_local import LocalCluster
    from kvrelay.v1 import inference_pb2 as ipb
    from kvrelay.v1 import inference_pb2_grpc as igrpc

    if args.speedup <= 0 or (args.length_scale is not None and args.length_scale <= 0):
        print("kvrelay: --speedup and --length-scale must be positive", file=sys.stderr)
        return 2
    try:
        reqs = load_trace(args.trace, args.format, args.limit)
    except TraceError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    cluster = None
    try:
        address = args.router
        policy = "?"
        if address is None:
            try:
                cfg = load_config(args.config)
            except ConfigError as exc:
                print(f"kvrelay: {exc}", file=sys.stderr)
                return 2
            cfg.router.port = 0
            policy = cfg.router.policy
            cluster = LocalCluster(cfg, _resolve_model(cfg.model.path, args.cache_dir))
            address = cluster.start()
        with grpc.insecure_channel(address) as ch:
            try:
                model = igrpc.InferenceStub(ch).ListModels(ipb.ListModelsRequest(), timeout=30).models[0]
            except grpc.RpcError as exc:
                return _grpc_error(exc)
        scale = args.length_scale or 1.0
        too_long = check_lengths(reqs, scale, model.context_window)
        if too_long and args.length_scale is None:
            worst = max(r.input_tokens + r.output_tokens for r in reqs)
            print(f"kvrelay: {len(too_long)} of {len(reqs)} requests exceed {model.name}'s context window of "
                  f"{model.context_window} tokens (longest {worst}); pass --length-scale, e.g. "
                  f"--length-scale {0.95 * model.context_window / worst:.3g}", file=sys.stderr)
            return 2
        reason = ""
        if args.length_scale is not None:
            reason = f"--length-scale {scale:g} given"
            if too_long:
                reason += f"; {len(too_long)} request(s) still exceed the context window and are sent anyway " \
                          "(they fail and are reported)"
        prompts = build_prompts(reqs, scale, VOCAB_RANGE, seed=args.seed)
        rcfg = ReplayConfig(speedup=args.speedup, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                            progress=not args.no_progress)
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        records, samples = asyncio.run(replay(address, prompts, rcfg))
        meta = {"trace": str(args.trace), "format": args.format or "auto", "limit": args.limit,
                "speedup": args.speedup, "length_scale": scale, "scale_reason": reason, "seed": args.seed,
                "model": model.name, "context_window": model.context_window, "router": address,
                "policy": policy, "started": started,
                "config": cluster.cfg.to_dict() if cluster is not None else None,
                "trace_slice": [{"index": r.index, "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
                                 "output_tokens": r.output_tokens} for r in reqs]}
        report = build_report(records, samples, rcfg, meta)
        write_report(report, Path(args.out))
        print((Path(args.out) / "report.md").read_text())
        return 0 if report["summary"]["failed"] == 0 else 1
    finally:
        if cluster is not None:
            cluster.stop()


def cmd_generate_local(args: argparse.Namespace) -> int:
    """Runs the engine in this process (no cluster) and streams the answer."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    path = _resolve_model(args.model, args.cache_dir)
    eng = LLMEngine(EngineConfig(model_path=path, dtype=args.dtype))
    tok = eng.tokenizer
    ids = (tok.encode_chat([{"role": "user", "content": args.prompt}]) if tok.has_chat_template and not args.raw
           else tok.encode(args.prompt))
    eng.add_request("cli", ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                               seed=args.seed))
    while eng.has_unfinished():
        for out in eng.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs the cluster in the foreground until Ctrl-C / SIGTERM."""
    import signal
    import time

    from cluster.config import load_config
    from cluster.launch_local import LocalCluster

    cfg = load_config(args.config)
    if args.port is not None:
        cfg.router.port = args.port
    model_path = _resolve_model(cfg.model.path, args.cache_dir)
    cluster = LocalCluster(cfg, model_path, log_level=args.log_level)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        addr = cluster.start()
        n = len(cluster.children) - 1
        print(f"kvrelay: serving {model_path.name} on {addr} with {n} workers "
              f"(try: kvrelay generate --router {addr} \"What is the capital of France?\")", flush=True)
        while not stop:
            dead = cluster.dead_children()
            if any(c.name == "router" for c in dead):
                print("kvrelay: the router exited; stopping", file=sys.stderr)
                return 1
            for c in dead:
                print(f"kvrelay: {c.name} exited with code {c.proc.returncode}", file=sys.stderr)
                cluster.children.remove(c)
            time.sleep(0.5)
        return 0
    finally:
        cluster.stop()
        print("kvrelay: stopped", flush=True)


def _grpc_error(exc) -> int:
    print(f"kvrelay: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1


def cmd_generate(args: argparse.Namespace) -> int:
    """Streams an answer from a running cluster."""
    import grpc

    from kvrelay.v1 import inference_pb2 as ipb
    from kvrelay.v1 import inference_pb2_grpc as igrpc

    req = ipb.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, raw_prompt=args.raw,
                              allowed_jurisdictions=args.jurisdiction or [])
    req.sampling.temperature = args.temperature
    if args.seed is not None:
        req.sampling.seed = args.seed
    finish = None
    with grpc.insecure_channel(args.router) as ch:
        try:
            for msg in igrpc.InferenceStub(ch).Generate(req, timeout=args.timeout):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.HasField("finish"):
                    finish = msg.finish
        except grpc.RpcError as exc:
            sys.stdout.write("\n")
            return _grpc_error(exc)
    sys.stdout.write("\n")
    if args.verbose and finish is not None:
        pl = finish.placement
        print(f"[{finish.usage.prompt_tokens} prompt + {finish.usage.completion_tokens} tokens; "
              f"prefill {pl.prefill_worker}, decode {pl.decode_worker}, ttft {pl.ttft_ms:.0f} ms, "
              f"kv {pl.kv_bytes} bytes]", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from kvrelay.v1 import worker_pb2 as wpb
    from kvrelay.v1 import worker_pb2_grpc as wgrpc

    with grpc.insecure_channel(args.router) as ch:
        try:
            resp = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)
        except grpc.RpcError as exc:
            return _grpc_error(exc)
    rows = [("WORKER", "SITE", "ROLE", "HEALTH", "INFLIGHT", "RUNNING", "WAITING", "KV FREE/TOTAL", "CACHED",
             "PREFILL TOK/S", "TRANSPORT", "ADDRESS")]
    for w in resp.workers:
        role = "prefill" if w.info.role == wpb.ROLE_PREFILL else "decode"
        health = "draining" if w.draining else "ok" if w.healthy else "UNHEALTHY"
        rows.append((w.info.worker_id, w.info.site, role, health, str(w.inflight), str(w.load.running),
                     str(w.load.waiting), f"{w.load.free_blocks}/{w.load.total_blocks}", str(w.cached_blocks),
                     f"{w.load.prefill_tokens_per_s:.0f}", w.info.transport, w.info.address))
    _table(rows)
    print(f"\nplacement policy: {resp.policy}\n")
    _table([("LINK", "RTT MS", "GBPS", "TRANSPORT", "ENCRYPT", "STATE")] + [
        (lk.name, f"{lk.rtt_ms:g}", f"{lk.gbps:g}", lk.transport, "yes" if lk.encrypt else "no",
         "up" if lk.up else "DOWN") for lk in resp.links])
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay", description="Disaggregated, multi-site LLM inference.")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where prepared models live (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="prepare or generate model checkpoints").add_subparsers(
        dest="model_command", required=True)
    prep = model.add_parser("prepare", help="convert the embedded SmolLM2-135M-Instruct once; print its folder")
    prep.set_defaults(func=cmd_model_prepare)
    tiny = model.add_parser("tiny", help="write a small seeded random checkpoint (tests)")
    tiny.add_argument("--arch", default="llama", choices=["llama", "llama3", "qwen2", "mistral"])
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_model_tiny)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
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

    serve = sub.add_parser("serve", help="run the cluster (router + workers) in the foreground")
    serve.add_argument("--config", help="cluster config YAML (default: one site, one prefill + one decode worker, "
                                        "the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--port", type=int, help="router port (overrides the config; 0 = any free port)")
    serve.add_argument("--log-level", default="WARNING")
    serve.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="stream an answer from a running cluster")
    g.add_argument("prompt")
    g.add_argument("--router", default="127.0.0.1:50051")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    g.add_argument("--jurisdiction", action="append", help="allowed jurisdiction (repeatable)")
    g.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    g.add_argument("-v", "--verbose", action="store_true", help="print usage and placement")
    g.set_defaults(func=cmd_generate)

    st = sub.add_parser("status", help="workers, their site, role and load")
    st.add_argument("--router", default="127.0.0.1:50051")
    st.set_defaults(func=cmd_status)

    bk = bench.add_parser("kv", help="KV transfer throughput vs raw sockets and memcpy; layer-wise overlap")
    bk.add_argument("--sizes", default="1,16,256,1024", help="MiB of KV per transfer, comma-separated")
    bk.add_argument("--streams", default="1,4")
    bk.add_argument("--repeat", type=int, default=3)
    bk.add_argument("--model", help="checkpoint for the overlap measurement (default: the embedded model)")
    bk.add_argument("--no-overlap", action="store_true", help="skip the 4k-token layer-wise overlap run")
    bk.set_defaults(func=cmd_bench_kv)

    bp = bench.add_parser("placement", help="placement decision and prefix-index lookup time")
    bp.add_argument("--workers", type=int, default=1000)
    bp.add_argument("--sites", type=int, default=10)
    bp.add_argument("--prompt-tokens", type=int, default=8192)
    bp.add_argument("--decisions", type=int, default=500)
    bp.set_defaults(func=cmd_bench_placement)

    br = bench.add_parser("replay", help="replay a request trace (Azure CSV or Mooncake JSONL) and report")
    br.add_argument("--trace", required=True, type=Path, help="trace file")
    br.add_argument("--format", choices=["azure", "mooncake"], help="default: from the file's first line")
    br.add_argument("--config", help="cluster to start (default: the embedded default); ignored with --router")
    br.add_argument("--router", help="replay against this running router instead of starting a cluster")
    br.add_argument("--limit", type=int, help="first N requests of the trace")
    br.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    br.add_argument("--length-scale", type=float, help="multiply every input and output length by this")
    br.add_argument("--slo-ttft", type=float, help="TTFT objective in seconds (for goodput)")
    br.add_argument("--slo-tpot", type=float, help="TPOT objective in seconds (for goodput)")
    br.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    br.add_argument("--no-progress", action="store_true")
    br.add_argument("--out", required=True, help="directory for report.json and report.md")
    br.set_defaults(func=cmd_bench_replay)

    gen = sub.add_parser("generate-local", help="generate with an in-process engine (no cluster)")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.set_defaults(func=cmd_generate_local)
    return p


def main(argv: list[str] | None = None) -> int:
    from engine.errors import EngineError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (EngineError, ValueError, OSError) as exc:
        print(f"kvrelay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
