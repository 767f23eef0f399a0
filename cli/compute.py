"""The `kvrelay` commands that run torch in this process: model tiny, generate-local, bench
(engine, vllm-pd, kv, kv-gate, telemetry, kv-codec) and sim profile. Kept apart from
cli/local.py so that the commands that run no model here (serve, model prepare, demo,
placement) start without importing torch (3 s); cli/main.py reaches these through
cli/lazy.py, only when their command runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrelay.benchmarks import codec_bench, codec_quality, telemetry_bench
from kvrelay.benchmarks.engine_bench import format_result, run_engine_bench, to_json
from kvrelay.benchmarks.gate_bench import format_gate, run_gate_bench
from kvrelay.benchmarks.kv_bench import format_kv, kv_json, run_kv_bench
from kvrelay.benchmarks.kv_wan import add_wan
from kvrelay.benchmarks.machine import emit_report, machine
from kvrelay.benchmarks.sim.profiler import ProfileGrid, Profiler
from kvrelay.benchmarks.traces import SAMPLE_AZURE
from kvrelay.benchmarks.vllm_pd import SYSTEMS, VllmPdConfig, format_vllm_pd, run_vllm_pd_bench
from kvrelay.cli.local import resolve_model
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tiny import write_tiny_checkpoint
from kvrelay.kvtransfer.protection import Protection
from kvrelay.launch.cities import CitiesError, check_privileges
from kvrelay.launch.vllm_env import installed_version


def cmd_model_tiny(args: argparse.Namespace) -> int:
    print(write_tiny_checkpoint(Path(args.out), args.arch, seed=args.seed))
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    if args.vllm_rounds < 1:
        raise SystemExit("kvrelay bench engine: --vllm-rounds must be >= 1")
    path = resolve_model(args.model, args.cache_dir)
    batches = tuple(int(b) for b in args.batches.split(","))
    for dtype in args.dtype.split(","):
        r = run_engine_bench(path, dtype=dtype, threads=args.threads, batches=batches,
                             new_tokens=args.new_tokens, repeat=args.repeat, with_hf=not args.no_reference,
                             with_vllm=args.engine == "vllm", vllm_rounds=args.vllm_rounds)
        print(format_result(r), flush=True)
        if args.json:
            Path(args.json).with_suffix(f".{dtype}.json").write_text(to_json(r))
    return 0


def cmd_bench_vllm_pd(args: argparse.Namespace) -> int:
    """vLLM alone against kvrelay P/D with vLLM and builtin pools (benchmarks/vllm_pd.py)."""
    if installed_version() is None:
        raise SystemExit("kvrelay bench vllm-pd: vLLM is not installed (make vllm)")
    if args.requests < 1 or args.request_rate <= 0 or args.length_scale <= 0 or args.tail_prompts < 0:
        raise SystemExit("kvrelay bench vllm-pd: --requests >= 1, --request-rate and --length-scale > 0, "
                         "--tail-prompts >= 0")
    systems = tuple(s.strip() for s in args.systems.split(","))
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise SystemExit(f"kvrelay bench vllm-pd: --systems: unknown {', '.join(unknown)} "
                         f"(known: {', '.join(SYSTEMS)})")
    cfg = VllmPdConfig(trace=args.trace or SAMPLE_AZURE, requests=args.requests, length_scale=args.length_scale,
                       max_output_tokens=args.max_output_tokens, request_rate=args.request_rate,
                       tail_prompts=args.tail_prompts, seed=args.seed, systems=systems)
    report = run_vllm_pd_bench(resolve_model(None, args.cache_dir), cfg)
    print(format_vllm_pd(report))
    if args.json:
        out = report | {"command": "kvrelay bench vllm-pd " + " ".join(sys.argv[3:])}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
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


def cmd_bench_kv_gate(args: argparse.Namespace) -> int:
    if min(args.blocks, args.transfers, args.idle) < 1:
        print("kvrelay bench kv-gate: --blocks, --transfers and --idle must be >= 1", file=sys.stderr)
        return 2
    res = run_gate_bench(args.blocks, args.transfers, args.idle)
    print(format_gate(res))
    if args.json:
        out = {"command": "kvrelay bench kv-gate " + " ".join(sys.argv[3:]), "machine": machine(), **res.to_dict()}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
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


def cmd_bench_kv_codec(args: argparse.Namespace) -> int:
    """KV codecs: ratio and speed per core, then perplexity and agreement with the prompt's KV under each."""
    try:
        setup = codec_quality.QualitySetup(prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                                           windows=args.windows, prompts=args.prompts,
                                           greedy_tokens=args.greedy_tokens)
        setup.check()
    except ValueError as e:
        raise SystemExit(f"kvrelay bench kv-codec: {e}") from None
    if args.mib < 1:
        raise SystemExit("kvrelay bench kv-codec: --mib must be >= 1")
    model = resolve_model(args.model, args.cache_dir)
    report = {"command": "kvrelay bench kv-codec " + " ".join(sys.argv[3:]),
              "speed": codec_bench.run(args.mib, 3),
              "quality": codec_quality.run(model, setup, dtype=args.dtype)}
    emit_report(report, args.json)
    return 0


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


def cmd_profile(args: argparse.Namespace) -> int:
    if args.threads < 1 or args.sharing < 1 or args.repeats < 1:
        print("kvrelay: --threads, --sharing and --repeats must be at least 1", file=sys.stderr)
        return 2
    grid = ProfileGrid(repeats=args.repeats)
    if args.quick:
        grid = ProfileGrid(prompts=(16, 128, 512), chunks=((512, 256),), batches=(1, 8), contexts=(64, 512),
                           mixed=((8, 256, 128),), repeats=args.repeats)
    path = resolve_model(args.model, args.cache_dir)
    profiler = Profiler(str(path), args.dtype, args.threads, grid.blocks())
    prof = profiler.profile(grid, args.name or Path(path).name, args.sharing)
    prof.save(Path(args.out))
    print(f"profile of {prof.model.name} ({prof.dtype}, {args.threads or 'default'} thread(s)) -> {args.out}")
    print(f"  step = {prof.c0 * 1e3:.2f} ms + {prof.c_prefill * 1e6:.1f} us/prompt token + "
          f"{prof.c_decode * 1e6:.1f} us/decoded sequence + {prof.c_attend * 1e9:.2f} ns/prompt attention pair + "
          f"{prof.c_context * 1e6:.2f} us/decode context token")
    print(f"  fit: {prof.fit['points']} points, median relative error {prof.fit['median_rel_error']:.1%}")
    return 0
