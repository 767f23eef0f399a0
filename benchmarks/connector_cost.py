"""What kvrelay's vLLM connector costs a decode (issue 34: "the per-layer hooks
must not slow decode"), measured two ways on vLLM's offline engine, each run
in a fresh process (in-process engine core, as in a vLLM pool):

- ``wall``: one generate call (batch 1, a 32-token prompt, ``new_tokens``
  new tokens) timed ``calls`` times, without and with the connector, in turn
  for ``rounds`` rounds (a drift of the machine hits both alike);
- ``hooks_share``: one such call with the connector under cProfile, the
  time spent in the connector's code and in vLLM's plumbing around it (the
  attention wrapper's own time, the connector output per step) over the
  call's time. The profiler's per-call cost counts in, so it is an upper
  bound, and unlike the wall times it does not move with the machine's noise.

Run: ``python -m kvrelay.benchmarks.connector_cost --model DIR [--rounds N]
[--json F]`` (needs vLLM: ``make vllm``). The JSON field names are stable."""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import multiprocessing
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvrelay.benchmarks.engine_bench import offline_vllm
from kvrelay.benchmarks.machine import emit_report, machine

HOOK_FILES = ("runtime/vllm_connector.py", "runtime/vllm_bridge.py", "attention/kv_transfer_utils.py",
              "kv_transfer/kv_transfer_state.py", "kv_connector/v1/base.py", "kv_connector_model_runner_mixin.py")
"""Where the connector's per-layer and per-step work lives (kvrelay's, and vLLM's around it)."""


def _measure(model: str, connector: bool, calls: int, new_tokens: int, threads: int) -> dict[str, Any]:
    """In a fresh process: wall times of ``calls`` generate calls, and with ``connector`` the hooks' share."""
    torch.set_num_threads(threads)
    import vllm
    from vllm.inputs import TokensPrompt

    llm = offline_vllm(Path(model), "float32", connector)
    prompt = [TokensPrompt(prompt_token_ids=list(range(100, 132)))]
    sp = vllm.SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompt, sp, use_tqdm=False)  # warm-up
    wall = []
    for _ in range(calls):
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        wall.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"wall_s": wall}
    if connector:
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(llm.generate, prompt, sp, use_tqdm=False)
        total = time.perf_counter() - t0
        stats: dict = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # (file, line, name) -> (.., tottime, ..)
        hooks = sum(v[2] for (path, _, _), v in stats.items() if path.endswith(HOOK_FILES))
        out |= {"profiled_s": total, "hooks_s": hooks}
    return out


def run(model: str, rounds: int, calls: int, new_tokens: int, threads: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(rounds):
        for connector in (False, True):
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
                runs[connector].append(pool.submit(_measure, model, connector, calls, new_tokens, threads)
                                       .result(timeout=1800))
    plain = [t for r in runs[False] for t in r["wall_s"]]
    hooked = [t for r in runs[True] for t in r["wall_s"]]
    share = [r["hooks_s"] / r["profiled_s"] for r in runs[True]]
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "threads": threads, "rounds": rounds,
            "calls": calls, "new_tokens": new_tokens, "plain_wall_s": plain, "connector_wall_s": hooked,
            "connector_over_plain": statistics.median(hooked) / statistics.median(plain),
            "hooks_share": max(share)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="connector_cost", description="kvrelay's vLLM connector: its cost on decode")
    p.add_argument("--model", required=True, help="checkpoint folder (the default model's: `kvrelay model prepare`)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--json", help="also write the report to this file")
    args = p.parse_args(argv)
    if min(args.rounds, args.calls, args.new_tokens, args.threads) < 1:
        p.error("--rounds, --calls, --new-tokens and --threads must be >= 1")
    emit_report(run(args.model, args.rounds, args.calls, args.new_tokens, args.threads), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
