"""The ``kvrelay`` command line: the parser of every command, and generate;
operator commands in cli/admin.py, the WAN emulation's in cli/cities.py; what
runs a model or a cluster here in cli/local.py, imported only when such a
command runs (cli/lazy.py), so the client commands load neither torch nor the
engine. A client command (generate, status, job, ...) is parsed by its own
module alone (:data:`CLIENT_COMMANDS`): `kvrelay generate` does not import the
simulator, the benchmarks or the config's validation to read its arguments.
Arguments and environment are read in these modules only; everything below
them receives typed values."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from kvrelay.cli.common import (
    NoRouter,
    add_connect_flags,
    client_dialer,
    default_cache_dir,
    default_token_file,
    grpc_error,
    routers_for,
)
from kvrelay.cli.lazy import Lazy, command_module, compute, local
from kvrelay.engine.errors import EngineError
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

AddFlags = Callable[[argparse.ArgumentParser], None]
"""A function that adds a module's flags to a parser (cli/cities.py's --cities, cli/chaos.py's --chaos)."""


def cmd_generate(args: argparse.Namespace) -> int:
    """Streams an answer from a running cluster."""


    req = ipb.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, raw_prompt=args.raw,
                              allowed_jurisdictions=args.jurisdiction or [], ignore_eos=args.ignore_eos)
    req.sampling.temperature = args.temperature
    if args.seed is not None:
        req.sampling.seed = args.seed
    if args.repetition_penalty is not None:
        req.sampling.repetition_penalty = args.repetition_penalty
    req.sampling.presence_penalty, req.sampling.frequency_penalty = args.presence_penalty, args.frequency_penalty
    req.sampling.min_p, req.sampling.min_tokens = args.min_p, args.min_tokens
    dialer = client_dialer(args)
    try:
        candidates = routers_for(args, dialer)
    except NoRouter as exc:
        print(f"kvrelay: error: {exc}", file=sys.stderr)
        return 1
    finish = None
    for i, address in enumerate(candidates):
        try:
            finish = _stream(dialer, address, req, args.timeout)
            break
        except _Unanswered as exc:  # a router that could not be reached, or went away: the next one goes on
            if i + 1 == len(candidates):
                sys.stdout.write("\n" if req.resume_token_ids else "")
                return grpc_error(exc.error)
            what = (f"went away after {len(req.resume_token_ids)} tokens; resuming at" if req.resume_token_ids
                    else "did not answer; trying")
            print(f"\nkvrelay: {address} ({exc.error.code().name}) {what} {candidates[i + 1]}", file=sys.stderr)
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


class _Unanswered(Exception):
    """A router that could not be reached, or that went away mid-answer (the request's
    ``resume_token_ids`` then hold what came: the next router continues after them)."""

    def __init__(self, error: grpc.RpcError) -> None:
        super().__init__(str(error))
        self.error = error


def _stream(dialer, address: str, req: ipb.GenerateRequest, timeout_s: float) -> ipb.Finish | None:
    """Prints the answer from the router at ``address`` as it streams; its finish. _Unanswered when the
    router could not be reached or went away (UNAVAILABLE), so another may be tried; the tokens that
    came are added to ``req.resume_token_ids``, with the last message's ``resume_ticket`` (another router
    continues after them)."""
    finish = None
    with dialer.sync(address) as ch:
        try:
            for msg in igrpc.InferenceStub(ch).Generate(req, timeout=timeout_s):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.HasField("finish"):
                    finish = msg.finish
                elif msg.token_ids:
                    req.resume_token_ids.extend(msg.token_ids)
                    req.resume_ticket = msg.resume_ticket  # the proof another router asks for
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise _Unanswered(exc) from None
            raise
    return finish


PARSER_MODULES = ("admin", "login", "pki", "stores", "jobs", "usage", "governance", "audit", "trace", "sim")
"""The cli modules whose ``add_parsers(sub)`` add top-level commands, in the order `kvrelay --help` lists
them (cli/cities.py adds its own and bench's)."""
CLIENT_COMMANDS = {"status": "admin", "routers": "admin", "scale": "admin", "drain": "admin", "pools": "admin",
                   "token": "admin", "pki": "pki", "job": "jobs", "usage": "usage", "governance": "governance",
                   "audit": "audit", "trace": "trace", "login": "login", "logout": "login"}
"""The client and operator commands, each parsed by its module alone (not plan: cli/sim.py adds
``plan capacity``): such a call imports neither the simulator, the benchmarks, the engine nor the
config's validation (tests/unit/test_import_graph.py checks both, and the same help as the whole parser)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; of ``command`` alone when it is generate or a client command."""
    p = argparse.ArgumentParser(prog="kvrelay", description="Disaggregated, multi-site LLM inference.")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where prepared models live (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)
    if command == "generate":
        _add_generate_parser(sub)
        return p
    if command in CLIENT_COMMANDS:
        command_module(CLIENT_COMMANDS[command]).add_parsers(sub)
        return p
    cities, chaos = command_module("cities"), command_module("chaos")
    _add_model_parsers(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    _add_serve_parser(sub, cities.cities_flag)
    _add_generate_parser(sub)
    for name in PARSER_MODULES:
        command_module(name).add_parsers(sub)
    _add_bench_parsers(bench, cities.cities_flag, chaos.add_flags)
    cities.add_parsers(sub, bench)
    _add_generate_local_parser(sub)
    return p


def command_of(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word past the global options), or None. The one global
    option takes a value, which may follow as the next word however the option is abbreviated."""
    it = iter(argv)
    for word in it:
        if word.startswith("--") and "=" not in word and word != "--help":
            next(it, None)
        elif not word.startswith("-"):
            return word
    return None


def _add_model_parsers(sub) -> None:
    model = sub.add_parser("model", help="prepare or generate model checkpoints").add_subparsers(
        dest="model_command", required=True)
    prep = model.add_parser("prepare", help="convert the embedded SmolLM2-135M-Instruct once; print its folder")
    prep.set_defaults(func=local("cmd_model_prepare"))
    tiny = model.add_parser("tiny", help="write a small seeded random checkpoint (tests)")
    tiny.add_argument("--arch", default="llama", choices=["llama", "llama3", "qwen2", "mistral"])
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=compute("cmd_model_tiny"))


def _add_serve_parser(sub, cities_flag: AddFlags) -> None:
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
    serve.set_defaults(func=local("cmd_serve"))


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="stream an answer from a running cluster")
    g.add_argument("prompt")
    add_connect_flags(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--repetition-penalty", type=float, help="vLLM's, over prompt and output: (0, 2], 1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], over the output")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], over the output")
    g.add_argument("--min-p", type=float, default=0.0, help="[0, 1]: drop tokens below min_p x the top one's")
    g.add_argument("--min-tokens", type=int, default=0, help="at least this many tokens")
    g.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token "
                                                               "(an answer of exactly --max-tokens)")
    g.add_argument("--jurisdiction", action="append", help="allowed jurisdiction (repeatable)")
    g.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    g.add_argument("-v", "--verbose", action="store_true", help="print usage and placement")
    g.set_defaults(func=cmd_generate)


def _add_bench_engine_parser(bench) -> None:
    """bench engine: kvrelay's engine against transformers (and vLLM) in one run."""
    be = bench.add_parser("engine", help="engine vs transformers: prefill and decode throughput")
    be.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    be.add_argument("--dtype", default="float32", help="comma-separated dtypes (float32, bfloat16)")
    be.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    be.add_argument("--batches", default="1,8,32")
    be.add_argument("--new-tokens", type=int, default=64)
    be.add_argument("--repeat", type=int, default=3)
    be.add_argument("--no-reference", action="store_true", help="skip transformers")
    be.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                    help="vllm: also measure vLLM's offline engine in the same run, beside kvrelay's (builtin)")
    be.add_argument("--vllm-rounds", type=int, default=1,
                    help="vLLM without and with kvrelay's connector, this many times in turn (medians)")
    be.add_argument("--json", help="also write results to this path (.<dtype>.json)")
    be.set_defaults(func=compute("cmd_bench_engine"))


def _add_bench_vllm_pd_parser(bench) -> None:
    """bench vllm-pd: vLLM alone, kvrelay P/D with vLLM pools and with builtin pools, one run, one client."""
    bv = bench.add_parser("vllm-pd", help="vLLM alone vs kvrelay P/D with vLLM and builtin pools (vllm bench serve)")
    bv.add_argument("--trace", type=Path, help="Azure CSV trace (default: the shared sample)")
    bv.add_argument("--requests", type=int, default=16, help="first N requests of the trace")
    bv.add_argument("--length-scale", type=float, default=0.25, help="multiply prompt lengths by this")
    bv.add_argument("--max-output-tokens", type=int, default=32)
    bv.add_argument("--request-rate", type=float, default=0.5, help="requests per second (Poisson)")
    bv.add_argument("--tail-prompts", type=int, default=3, help="2k-token prompts for the exposed transfer tail")
    bv.add_argument("--seed", type=int, default=0)
    bv.add_argument("--systems", default="vllm_alone,vllm_nixl_pd,kvrelay_vllm,kvrelay_builtin",
                    help="comma-separated systems to run, in this order")
    bv.add_argument("--json", help="also write the report to this file")
    bv.set_defaults(func=compute("cmd_bench_vllm_pd"))


def _add_bench_kv_codec_parser(bench) -> None:
    """bench kv-codec: the KV codecs' ratio and speed, and their cost in answers (issue 35)."""
    bkc = bench.add_parser("kv-codec", help="KV codecs: ratio, speed per core, and perplexity and greedy agreement "
                                             "with the prompt's KV passed through each")
    bkc.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    bkc.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the engine's and KV's dtype")
    bkc.add_argument("--prefix-tokens", type=int, default=256, help="tokens whose KV goes through the codec (x16)")
    bkc.add_argument("--suffix-tokens", type=int, default=256, help="tokens scored after the prefix, per window")
    bkc.add_argument("--windows", type=int, default=8, help="perplexity windows of real text")
    bkc.add_argument("--prompts", type=int, default=32, help="greedy prompts compared")
    bkc.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens that must match per prompt")
    bkc.add_argument("--mib", type=int, default=64, help="bf16 KV per speed measurement")
    bkc.add_argument("--json", help="also write the report to this file")
    bkc.set_defaults(func=compute("cmd_bench_kv_codec"))


def _add_bench_routers_parser(bench) -> None:
    br = bench.add_parser("routers", help="one router against one per site (etcd): prefix hit rate and TTFT on "
                                          "the same prefix-sharing trace slice")
    br.add_argument("--trace", required=True, help="a Mooncake-format trace (prompts sharing prefix blocks), e.g. "
                                                  "../shared/traces/synthetic_trace.jsonl")
    br.add_argument("--start", type=int, default=0, help="the trace's first request sent (default: %(default)s)")
    br.add_argument("--limit", type=int, default=60, help="requests sent (default: %(default)s)")
    br.add_argument("--scale", type=float, default=1 / 32, help="prompt length scale (default: %(default)s)")
    br.add_argument("--json", help="also write the report to this file")
    br.set_defaults(func=local("cmd_bench_routers"))


def _add_bench_parsers(bench, cities_flag: AddFlags, chaos_flags: AddFlags) -> None:
    """bench engine, kv, placement and replay (bench cities comes with the cities commands)."""
    _add_bench_engine_parser(bench)
    _add_bench_vllm_pd_parser(bench)

    bk = bench.add_parser("kv", help="KV transfer throughput vs raw sockets and memcpy; layer-wise overlap")
    bk.add_argument("--sizes", default="1,16,256", help="MiB of KV per transfer, comma-separated")
    bk.add_argument("--streams", default="1,4")
    bk.add_argument("--modes", default="aead,integrity", help="protections to measure, comma-separated")
    bk.add_argument("--json", help="write the results (one record per size, streams and mode) to this file")
    bk.add_argument("--wan", action="store_true",
                    help="also over an emulated 1 Gbit/s, 60 ms link (root: kvrelay cities)")
    bk.add_argument("--repeat", type=int, default=3)
    bk.add_argument("--model", help="checkpoint for the overlap measurement (default: the embedded model)")
    bk.add_argument("--no-overlap", action="store_true", help="skip the 4k-token layer-wise overlap run")
    bk.set_defaults(func=compute("cmd_bench_kv"))

    bp = bench.add_parser("placement", help="placement decision and prefix-index lookup time")
    bp.add_argument("--workers", default="1000", help="worker counts, comma-separated (e.g. 1000,10000)")
    bp.add_argument("--sites", type=int, default=10)
    bp.add_argument("--prompt-tokens", type=int, default=8192)
    bp.add_argument("--decisions", type=int, default=500)
    bp.add_argument("--json", help="also write p50/p99 of hashing, lookup, place and their sum to this file")
    bp.set_defaults(func=local("cmd_bench_placement"))
    _add_replay_parser(bench, cities_flag, chaos_flags)
    _add_hardening_parsers(bench)
    bte = bench.add_parser("telemetry", help="TTFT and decode tokens/s with every request traced vs telemetry off")
    bte.add_argument("--requests", type=int, default=24, help="measured requests per cluster (after 2 warm-up)")
    bte.add_argument("--seed", type=int, default=0)
    bte.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    bte.add_argument("--json", help="also write the report to this file")
    bte.set_defaults(func=compute("cmd_bench_telemetry"))

    _add_bench_kv_codec_parser(bench)
    _add_bench_routers_parser(bench)
    _add_bench_handshakes_parser(bench)

    bg = bench.add_parser("kv-gate", help="a real sender's KV transfer time, quiet and under a flood of idle "
                                          "connections and replayed hellos (from 127.0.0.2 and 127.0.0.3)")
    bg.add_argument("--blocks", type=int, default=16, help="blocks per transfer (720 KiB each)")
    bg.add_argument("--transfers", type=int, default=20, help="transfers, quiet and then under the flood")
    bg.add_argument("--idle", type=int, default=200, help="idle connections the flood holds open")
    bg.add_argument("--json", help="also write the result to this file")
    bg.set_defaults(func=compute("cmd_bench_kv_gate"))

    bt = bench.add_parser("tls", help="TTFT and gRPC round trip with TLS against the same build with TLS off")
    bt.add_argument("--config", help="cluster of both runs (default: the embedded default)")
    bt.add_argument("--prompt-tokens", type=int, default=256)
    bt.add_argument("--requests", type=int, default=40, help="measured requests per cluster (after 4 warm-up)")
    bt.add_argument("--rtt-calls", type=int, default=400, help="unary calls per cluster for the round trip")
    bt.add_argument("--checked", action="store_true",
                    help="the TLS cluster lists a revoked serial, so its channels check revocation themselves "
                         "(runtime/checked_tls.py): what that costs")
    bt.add_argument("--json", help="also write the result to this file")
    bt.set_defaults(func=local("cmd_bench_tls"))


def _add_bench_handshakes_parser(bench) -> None:
    bh = bench.add_parser("handshakes", help="a call on a new TLS channel: renewable (dynamic) server credentials "
                                             "against static ones, in one run")
    bh.add_argument("--connections", type=int, default=300, help="new channels per server (after 20 warm-up)")
    bh.add_argument("--renew-every", type=int, default=10, help="the renewing server's material renewed every N")
    bh.add_argument("--json", help="also write the result to this file")
    bh.set_defaults(func=local("cmd_bench_handshakes"))


def _add_replay_parser(bench, cities_flag: AddFlags, chaos_flags: AddFlags) -> None:
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
    chaos_flags(br)
    br.set_defaults(func=local("cmd_bench_replay"))


def _hardening_common(p: argparse.ArgumentParser, command: str) -> None:
    """The flags every hardening benchmark takes, and its function (cli/bench_hardening.py)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--json", help="also write the report to this file")
    p.set_defaults(func=Lazy("kvrelay.cli.bench_hardening", command))


def _add_hardening_parsers(bench) -> None:
    """bench fuzz, bench overload and bench fairness."""
    bfa = bench.add_parser("fairness", help="a tenant's interactive TTFT while another's batch job saturates")
    bfa.add_argument("--interactive", type=int, default=12, help="interactive requests per phase")
    bfa.add_argument("--job-requests", type=int, default=400, help="requests of the flooding batch job")
    _hardening_common(bfa, "cmd_bench_fairness")
    bf = bench.add_parser("fuzz", help="fuzz the HTTP, gRPC and KV ports and the config loader; report leaks")
    bf.add_argument("--minutes", type=float, default=5.0)
    _hardening_common(bf, "cmd_bench_fuzz")
    bo = bench.add_parser("overload", help="offer several times the sustainable rate: shed vs admitted, TTFT, memory")
    bo.add_argument("--factor", type=float, default=5.0, help="offered rate in multiples of the sustainable one")
    bo.add_argument("--seconds", type=float, default=60.0, help="length of the overload")
    bo.add_argument("--capacity-seconds", type=float, default=30.0, help="length of the capacity measurement")
    _hardening_common(bo, "cmd_bench_overload")


def _add_generate_local_parser(sub) -> None:
    gen = sub.add_parser("generate-local", help="generate with an in-process engine (no cluster)")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.set_defaults(func=compute("cmd_generate_local"))


def main(argv: list[str] | None = None) -> int:

    words = sys.argv[1:] if argv is None else argv
    args = build_parser(command_of(words)).parse_args(words)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (EngineError, ValueError, OSError, RuntimeError) as exc:
        print(f"kvrelay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
