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
