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


def cmd_bench_cities(args: argparse.Namespace) -> int:
    import datetime

    from benchmarks import cities_bench as cb
    from benchmarks.replay import ReplayConfig
    from benchmarks.traces import SAMPLE_AZURE, build_prompts, load_trace
    from cluster import cities

    args.trace = args.trace or SAMPLE_AZURE
    try:
        cities.check_privileges()
        emulate = True
    except cities.CitiesError as exc:
        print(f"kvrelay: no WAN emulation ({exc}); the links exist only in placement's figures", file=sys.stderr)
        emulate = False
    example = cb.load_example()
    chosen = [sc for sc in cb.scenarios(example) if not args.only or sc.name in args.only.split(",")]
    if not chosen:
        raise ValueError(f"--only {args.only!r} names no scenario "
                         f"({', '.join(sc.name for sc in cb.scenarios(example))})")
    reqs = load_trace(args.trace, args.format, args.limit)
    prompts = build_prompts(reqs, args.length_scale, VOCAB_RANGE, seed=args.seed)
    rcfg = ReplayConfig(speedup=args.speedup, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                        progress=not args.no_progress)
    model_path = _resolve_model(example.get("model", {}).get("path"), args.cache_dir)
    out = Path(args.out)
    meta = {"trace": str(args.trace), "limit": args.limit, "speedup": args.speedup,
            "length_scale": args.length_scale, "seed": args.seed, "wan_emulation": emulate,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "trace_slice": [{"index": r.index, "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
                             "output_tokens": r.output_tokens} for r in reqs],
            "scale_reason": f"--length-scale {args.length_scale:g}", "format": args.format or "auto"}
    rows = []
    for sc in chosen:
        print(f"kvrelay: scenario {sc.name}: {sc.what}", flush=True)
        report = cb.run_scenario(sc, model_path, prompts, rcfg, emulate, out, meta)
        rows.append(cb.summary_row(sc.name, sc.what, report))
    print(cb.write_summary(rows, out, meta))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _cities_for(args: argparse.Namespace):
    """The `kvrelay cities up` emulation when --cities was given, else None."""
    if not getattr(args, "cities", False):
        return None
    from cluster.cities import load_state

    st = load_state(args.state_dir)
    if st is None:
        raise ValueError("--cities: no emulated cities are up (run: kvrelay cities up --config FILE)")
    return st


def cmd_bench_replay(args: argparse.Namespace) -> int:
    from benchmarks.traces import TraceError, load_trace
    from cluster.config import ConfigError, load_config
    from cluster.launch_local import LocalCluster

    if args.speedup <= 0 or (args.length_scale is not None and args.length_scale <= 0):
        print("kvrelay: --speedup and --length-scale must be positive", file=sys.stderr)
        return 2
    try:
        reqs = load_trace(args.trace, args.format, args.limit)
    except TraceError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    if args.router is not None:
        return _replay(args, reqs, args.router, None)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    cfg.router.port = 0
    cluster = LocalCluster(cfg, _resolve_model(cfg.model.path, args.cache_dir), cities=_cities_for(args))
    try:
        return _replay(args, reqs, cluster.start(), cluster)
    finally:
        cluster.stop()


def _replay(args: argparse.Namespace, reqs, address: str, cluster) -> int:
    """Replays ``reqs`` against the router at ``address``; writes and prints the report."""
    import asyncio
    import datetime

    import grpc

    from benchmarks.replay import ReplayConfig, build_report, check_lengths, replay, write_report
    from benchmarks.traces import build_prompts
    from kvrelay.v1 import inference_pb2 as ipb
    from kvrelay.v1 import inference_pb2_grpc as igrpc

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
            "policy": cluster.cfg.router.policy if cluster is not None else "?", "started": started,
            "wan_emulation": cluster is not None and cluster.cities is not None,
            "config": cluster.cfg.to_dict() if cluster is not None else None,
            "trace_slice": [{"index": r.index, "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
                             "output_tokens": r.output_tokens} for r in reqs]}
    report = build_report(records, samples, rcfg, meta)
    write_report(report, Path(args.out))
    print((Path(args.out) / "report.md").read_text())
    return 0 if report["summary"]["failed"] == 0 else 1


def cmd_cities_up(args: argparse.Namespace) -> int:
    from cluster import cities
    from cluster.config import load_config

    st = cities.up(load_config(args.config), args.state_dir, args.subnet, args.prefix)
    print(f"kvrelay: {len(st.sites)} sites in namespaces, {len(st.links)} emulated links; "
          f"router address inside the emulation: {st.gateway}")
    _print_cities(st)
    print("\nnext: kvrelay cities check   |   kvrelay serve --config FILE --cities   |   kvrelay cities down")
    return 0


def _print_cities(st) -> None:
    from cluster.cities import link_alive

    _table([("SITE", "NAMESPACE", "SITE ADDRESS", "MGMT ADDRESS")] +
           [(s.name, s.netns, s.site_addr, s.mgmt_addr) for s in st.sites])
    print()
    _table([("LINK", "RTT MS", "GBPS", "DELAY LINE", "STATE")] +
           [(f"{lk.a}-{lk.b}", f"{lk.rtt_ms:g}", f"{lk.gbps:g}", str(lk.pid),
             "CUT" if lk.cut else "up" if link_alive(lk) else "DOWN (delay line gone)") for lk in st.links])


def cmd_cities_status(args: argparse.Namespace) -> int:
    from cluster.cities import load_state

    st = load_state(args.state_dir)
    if st is None:
        print("kvrelay: no emulated cities are up")
        return 1
    _print_cities(st)
    return 0


def cmd_cities_down(args: argparse.Namespace) -> int:
    from cluster.cities import down, load_state

    if load_state(args.state_dir) is None:
        print("kvrelay: no emulated cities are up")
        return 0
    problems = down(args.state_dir)
    for p in problems:
        print(f"kvrelay: could not remove {p}", file=sys.stderr)
    print("kvrelay: cities down" if not problems else "kvrelay: some parts remain (see above)")
    return 1 if problems else 0


def cmd_cities_check(args: argparse.Namespace) -> int:
    """Measures every emulated link both ways against its configured RTT and rate."""
    from cluster.cities import CitiesError, load_state
    from cluster.linkprobe import measure_link

    st = load_state(args.state_dir)
    if st is None:
        raise CitiesError("no emulated cities are up (run: kvrelay cities up --config FILE)")
    rows = [("LINK", "RTT MS (SET)", "RTT MS", "GBPS (SET)", "GBPS", "OK")]
    ok_all = True
    for lk in st.links:
        for src, dst in ((lk.a, lk.b), (lk.b, lk.a)):
            m = measure_link(st.site(src).netns, st.site(dst).netns, st.site(dst).site_addr, args.seconds)
            ok = abs(m.rtt_ms - lk.rtt_ms) <= 0.1 * lk.rtt_ms and abs(m.gbps - lk.gbps) <= 0.15 * lk.gbps
            ok_all &= ok
            rows.append((f"{src}->{dst}", f"{lk.rtt_ms:g}", f"{m.rtt_ms:.2f}", f"{lk.gbps:g}", f"{m.gbps:.3f}",
                         "yes" if ok else "NO"))
    _table(rows)
    print("\n(OK: RTT within 10% and one TCP stream's rate within 15% of the configured figures)")
    return 0 if ok_all else 1


def cmd_cities_cut(args: argparse.Namespace) -> int:
    from cluster.cities import link_signal

    a, b = args.link
    link_signal(args.state_dir, a, b, cut=args.cities_command == "cut")
    print(f"kvrelay: link {a}-{b} {'cut' if args.cities_command == 'cut' else 'restored'}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Three cities (emulated WAN when root), a short trace slice, the summary."""
    import tempfile

    from benchmarks.traces import SAMPLE_AZURE, load_trace
    from cluster import cities
    from cluster.config import load_config
    from cluster.launch_local import LocalCluster

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
        cluster = LocalCluster(cfg, _resolve_model(cfg.model.path, args.cache_dir), cities=st)
        try:
            address = cluster.start()
            print(f"kvrelay demo: cluster up (router {address}); replaying {len(reqs)} requests of the Azure "
                  f"code trace at 1/10 of their lengths", flush=True)
            replay_args = argparse.Namespace(trace=SAMPLE_AZURE, format="azure", limit=args.requests,
                                             speedup=1.0, length_scale=0.1, slo_ttft=args.slo_ttft,
                                             slo_tpot=args.slo_tpot, seed=0, no_progress=False, out=out)
            rc = _replay(replay_args, reqs, address, cluster)
        finally:
            cluster.stop()
    finally:
        if st is not None:
            cities.down(state_dir)
    print(f"kvrelay demo: the full report (report.json, report.md, plots) is in {out}")
    return rc


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
    backend = None
    if args.backend == "ray":
        if args.cities:
            raise ValueError("--cities runs workers in this machine's namespaces; it cannot be combined with "
                             "--backend ray")
        from cluster.launch_ray import RayBackend

        backend = RayBackend([s.name for s in cfg.sites], args.ray_address)
    cluster = LocalCluster(cfg, model_path, log_level=args.log_level, cities=_cities_for(args), backend=backend)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        addr = cluster.start()
        n = len(cluster.children) - 1
        if cluster.operator_token:
            _write_secret(args.token_file, cluster.operator_token)
            print(f"kvrelay: operator token for this run in {args.token_file} (kvrelay scale / drain read it)")
        print(f"kvrelay: serving {model_path.name} on {addr} with {n} workers ({args.backend}) "
              f"(try: kvrelay generate --router {addr} \"What is the capital of France?\")", flush=True)
        while not stop:
            if any(c.name == "router" for c in cluster.dead_children()):
                print("kvrelay: the router exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        cluster.stop()
        print("kvrelay: stopped", flush=True)


def _write_secret(path: Path, value: str) -> None:
    """Writes ``value`` to ``path``, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    tmp.rename(path)


def _operator_metadata(args: argparse.Namespace) -> tuple:
    """gRPC metadata with the operator token: $KVRELAY_OPERATOR_TOKEN, else --token-file."""
    token = os.environ.get("KVRELAY_OPERATOR_TOKEN", "")
    if not token and args.token_file.exists():
        token = args.token_file.read_text().strip()
    return (("authorization", f"Bearer {token}"),) if token else ()


def cmd_token(args: argparse.Namespace) -> int:
    import secrets

    from router.admin import token_sha256

    token = secrets.token_urlsafe(32)
    print(f"token (give it to the operator; it is not stored anywhere): {token}")
    print("config lines:\nauth:\n  operators:\n"
          f"    - {{name: {args.name}, token_sha256: {token_sha256(token)}}}")
    return 0


def _admin_call(args: argparse.Namespace, method: str, request):
    import grpc

    from kvrelay.v1 import admin_pb2_grpc as agrpc

    with grpc.insecure_channel(args.router) as ch:
        return getattr(agrpc.AdminStub(ch), method)(request, timeout=30, metadata=_operator_metadata(args))


def _pool_rows(pools) -> list[tuple[str, ...]]:
    return [("SITE", "ROLE", "DESIRED", "ACTIVE", "DRAINING", "UNHEALTHY", "WORKERS")] + [
        (p.site, p.role, str(p.desired), str(p.active), str(p.draining), str(p.unhealthy), " ".join(p.workers))
        for p in pools]


def cmd_scale(args: argparse.Namespace) -> int:
    import grpc

    from kvrelay.v1 import admin_pb2 as apb

    if args.replicas < 0:
        print(f"kvrelay: --replicas must be >= 0, got {args.replicas}", file=sys.stderr)
        return 2
    try:
        resp = _admin_call(args, "Scale", apb.ScaleRequest(site=args.site, role=args.role, replicas=args.replicas))
    except grpc.RpcError as exc:
        return _grpc_error(exc)
    _table(_pool_rows([resp.pool]))
    if resp.draining:
        print(f"draining (they leave once their requests are done): {', '.join(resp.draining)}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    import grpc

    from kvrelay.v1 import admin_pb2 as apb

    try:
        resp = _admin_call(args, "Drain", apb.DrainRequest(worker_id=args.worker))
    except grpc.RpcError as exc:
        return _grpc_error(exc)
    print(f"kvrelay: draining {args.worker}: no new requests; it leaves once its requests are done")
    _table(_pool_rows([resp.pool]))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import grpc

    from kvrelay.v1 import admin_pb2 as apb

    try:
        resp = _admin_call(args, "Plan", apb.PlanRequest(apply=args.apply))
    except grpc.RpcError as exc:
        return _grpc_error(exc)
    _table([("SITE", "ROLE", "NOW", "RECOMMENDED", "WHY")] + [
        (p.site, p.role, str(p.current), str(p.recommended), "; ".join(p.reasons)) for p in resp.plans])
    print(f"\n(figures of the last {resp.window_s:g} s; "
          f"{'applied' if resp.applied else 'not applied: add --apply'})")
    return 0


def cmd_pools(args: argparse.Namespace) -> int:
    import grpc

    from kvrelay.v1 import admin_pb2 as apb

    try:
        resp = _admin_call(args, "ListPools", apb.ListPoolsRequest())
    except grpc.RpcError as exc:
        return _grpc_error(exc)
    _table(_pool_rows(resp.pools))
    return 0


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

    from kvrelay.v1 import admin_pb2 as apb

    with grpc.insecure_channel(args.router) as ch:
        try:
            resp = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)
        except grpc.RpcError as exc:
            return _grpc_error(exc)
    try:
        _table(_pool_rows(_admin_call(args, "ListPools", apb.ListPoolsRequest()).pools))
    except grpc.RpcError as exc:
        print(f"(pools: {exc.details()})")
    print()
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


def default_token_file() -> Path:
    """Where `kvrelay serve` writes its per-run operator token: beside the model cache."""
    return default_cache_dir() / "operator-token"


def _operator_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", type=Path, default=default_token_file(),
                   help="operator token (default: %(default)s, written by kvrelay serve; "
                        "$KVRELAY_OPERATOR_TOKEN takes precedence)")


def _cities_flag(p: argparse.ArgumentParser) -> None:
    from cluster.cities import DEFAULT_STATE_DIR

    p.add_argument("--cities", action="store_true", help="run each site's workers in its namespace of the "
                   "emulation `kvrelay cities up` made (needs root)")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    from cluster.cities import DEFAULT_PREFIX, DEFAULT_STATE_DIR, DEFAULT_SUBNET

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
    serve.add_argument("--backend", choices=["local", "ray"], default="local",
                       help="where workers run: processes here, or Ray actors on each site's nodes")
    serve.add_argument("--ray-address", help="existing Ray cluster (default: start a local one)")
    serve.add_argument("--token-file", type=Path, default=default_token_file(),
                       help="where to write this run's operator token (default: %(default)s)")
    _cities_flag(serve)
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

    st = sub.add_parser("status", help="sites, pools, workers with load and KV usage, links")
    st.add_argument("--router", default="127.0.0.1:50051")
    _operator_flags(st)
    st.set_defaults(func=cmd_status)

    sc = sub.add_parser("scale", help="set a site's prefill or decode pool size (operators)")
    sc.add_argument("--site", required=True)
    sc.add_argument("--role", required=True, choices=["prefill", "decode"])
    sc.add_argument("--replicas", required=True, type=int)
    sc.add_argument("--router", default="127.0.0.1:50051")
    _operator_flags(sc)
    sc.set_defaults(func=cmd_scale)

    dr = sub.add_parser("drain", help="stop placing on a worker; it leaves once its requests are done (operators)")
    dr.add_argument("worker", help="worker id, e.g. montreal/decode/1")
    dr.add_argument("--router", default="127.0.0.1:50051")
    _operator_flags(dr)
    dr.set_defaults(func=cmd_drain)

    po = sub.add_parser("pools", help="desired and actual size of every pool (operators)")
    po.add_argument("--router", default="127.0.0.1:50051")
    _operator_flags(po)
    po.set_defaults(func=cmd_pools)

    pl = sub.add_parser("plan", help="recommended pool sizes from recent load and SLOs (operators)")
    pl.add_argument("--apply", action="store_true", help="set every pool to its recommended size")
    pl.add_argument("--router", default="127.0.0.1:50051")
    _operator_flags(pl)
    pl.set_defaults(func=cmd_plan)

    tk = sub.add_parser("token", help="make an operator token and print the config line with its hash")
    tk.add_argument("--name", default="operator", help="who holds it")
    tk.set_defaults(func=cmd_token)

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
    _cities_flag(br)
    br.set_defaults(func=cmd_bench_replay)

    bc = bench.add_parser("cities", help="one trace slice against colocated, same-city, 60 ms-away and "
                                         "three-city deployments (emulated WAN when root)")
    bc.add_argument("--trace", type=Path, default=None, help="trace file (default: the shipped Azure code slice)")
    bc.add_argument("--format", choices=["azure", "mooncake"])
    bc.add_argument("--limit", type=int, default=40)
    bc.add_argument("--speedup", type=float, default=1.0)
    bc.add_argument("--length-scale", type=float, default=0.1)
    bc.add_argument("--slo-ttft", type=float, default=2.0)
    bc.add_argument("--slo-tpot", type=float, default=0.5)
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument("--only", help="comma-separated scenario names")
    bc.add_argument("--no-progress", action="store_true")
    bc.add_argument("--out", required=True)
    bc.set_defaults(func=cmd_bench_cities)

    ci = sub.add_parser("cities", help="emulate the config's sites as cities joined by WAN links (root)")
    cis = ci.add_subparsers(dest="cities_command", required=True)
    cu = cis.add_parser("up", help="a network namespace per site, links with the configured RTT and rate")
    cu.add_argument("--config", required=True, help="cluster config YAML with sites and links")
    cu.add_argument("--subnet", default=DEFAULT_SUBNET, help="IPv4 /16 the emulation takes addresses from")
    cu.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace and interface name prefix (1-5 characters)")
    cu.set_defaults(func=cmd_cities_up)
    cd = cis.add_parser("down", help="remove the namespaces, links and delay lines")
    cd.set_defaults(func=cmd_cities_down)
    cs = cis.add_parser("status", help="sites, addresses and links of the running emulation")
    cs.set_defaults(func=cmd_cities_status)
    cc = cis.add_parser("check", help="measure every link's RTT and TCP rate against the configured ones")
    cc.add_argument("--seconds", type=float, default=4.0, help="bulk transfer time per direction")
    cc.set_defaults(func=cmd_cities_check)
    for verb, text in (("cut", "drop every packet on a link (fault injection)"), ("restore", "undo cut")):
        cx = cis.add_parser(verb, help=text)
        cx.add_argument("link", nargs=2, metavar="SITE", help="the link's two sites")
        cx.set_defaults(func=cmd_cities_cut)
    for c in (cu, cd, cs, cc, *[cis.choices[v] for v in ("cut", "restore")]):
        c.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="where the emulation's "
                       "state and delay-line logs live (default: %(default)s)")

    dm = sub.add_parser("demo", help="three cities over emulated WAN links, a short trace replay, the summary")
    dm.add_argument("--requests", type=int, default=20, help="requests of the Azure code trace to replay")
    dm.add_argument("--slo-ttft", type=float, default=10.0, help="TTFT objective, seconds")
    dm.add_argument("--slo-tpot", type=float, default=1.0, help="TPOT objective, seconds")
    dm.add_argument("--out", help="report directory (default: a new temporary one)")
    dm.set_defaults(func=cmd_demo)

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
    except (EngineError, ValueError, OSError, RuntimeError) as exc:
        print(f"kvrelay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
