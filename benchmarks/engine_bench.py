"""``kvrelay bench engine``: the engine against transformers' ``generate`` on
the same model, dtype and thread count, in one run, plus the memory-bandwidth
bound of batch-1 decode.

Decode figures for both sides are (batch x new tokens) / wall time of a
whole generate call on 32-token prompts, prefill included, as in the
platform baselines; the engine's decode-only rate is reported as well.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import multiprocessing
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from kvrelay.engine.config import CacheConfig, DType, EngineConfig, SchedulerConfig
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.launch.vllm_env import installed_version
from kvrelay.runtime.vllm_bridge import Bridge, register_bridge
from kvrelay.runtime.vllm_engine import CONNECTOR_CLASS, CONNECTOR_MODULE

CORPUS = ("Research and education networks connect universities, laboratories and hospitals across "
          "cities and countries. They carry physics data, genomes, climate models and lecture videos, "
          "and now they are asked to carry the working memory of language models between sites. ")


@dataclass(slots=True)
class EngineBenchResult:
    dtype: str
    threads: int
    prefill_tokens: int
    ours_prefill_tok_s: float
    hf_prefill_tok_s: float | None
    decode: dict[int, dict[str, float | None]] = field(default_factory=dict)
    """batch -> {ours, ours_decode_only, hf, vllm, vllm_connector} tokens/s (None: not measured)."""
    vllm_prefill_tok_s: float | None = None
    """vLLM's offline engine (``--engine vllm``) on the same prompt, dtype and cores."""
    vllm_connector_prefill_tok_s: float | None = None
    """The same with kvrelay's KV connector attached, as in a vLLM pool (``vllm_connector`` in ``decode``)."""
    vllm_rounds: int = 0
    """vLLM runs without and with the connector, in turn; each figure is their median (0: not measured)."""
    vllm_version: str | None = None
    memcpy_gb_s: float = 0.0
    read_gb_s: float = 0.0
    b1_bytes_per_step: int = 0
    b1_bound_tok_s: float = 0.0


def _prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(CORPUS * (1 + (n * length) // 40), add_special_tokens=False)
    return [ids[i * 7:i * 7 + length] for i in range(n)]


def measure_bandwidth(gib: float = 1.0) -> tuple[float, float]:
    """(copy GB/s counted as bytes copied, read-only GB/s) with torch."""
    n = int(gib * 2**30) // 4
    a = torch.ones(n)
    b = torch.empty_like(a)
    b.copy_(a)
    copy = []
    read = []
    for _ in range(3):
        t = time.perf_counter()
        b.copy_(a)
        copy.append(time.perf_counter() - t)
        t = time.perf_counter()
        a.sum()
        read.append(time.perf_counter() - t)
    nbytes = n * 4
    return nbytes / min(copy) / 1e9, nbytes / min(read) / 1e9


def _time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_ours(eng: LLMEngine, prompt512: list[int], batches: list[int], new_tokens: int,
               repeat: int) -> tuple[float, dict[int, tuple[float, float]]]:
    eng.pool.enable_prefix_caching = False
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.generate([prompt512], one)  # warm-up
    prefill = len(prompt512) / _time(lambda: eng.generate([prompt512], one), repeat)
    decode: dict[int, tuple[float, float]] = {}
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for b in batches:
        prompts = _prompts(eng.tokenizer, b, 32)
        eng.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        total = _time(lambda: eng.generate(prompts, params), repeat)  # noqa: B023 (called before the loop moves on)
        first = _time(lambda: eng.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True)), repeat)  # noqa: B023 (called before the loop moves on)
        decode[b] = (b * new_tokens / total, b * (new_tokens - 1) / max(1e-9, total - first))
    return prefill, decode


def bench_hf(path: Path, dtype: torch.dtype, tokenizer, prompt512: list[int], batches: list[int],
             new_tokens: int, repeat: int) -> tuple[float, dict[int, float]]:
    import transformers

    # Any: transformers' annotations of generate() change between releases (vLLM pins an older one)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    x = torch.tensor([prompt512])
    with torch.inference_mode():
        model(x)
        prefill = len(prompt512) / _time(lambda: model(x), repeat)
        out: dict[int, float] = {}
        for b in batches:
            ids = torch.tensor(_prompts(tokenizer, b, 32))
            mask = torch.ones_like(ids)

            def run():
                model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,  # noqa: B023 (called before the loop moves on)
                               do_sample=False, pad_token_id=0)
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
            out[b] = b * new_tokens / _time(run, repeat)
    return prefill, out


VLLM_MAX_MODEL_LEN = 1024
VLLM_KV_CACHE_GIB = "1"
VLLM_TIMEOUT_S = 1800.0
"""One vLLM measurement (start, prefill and every batch), at most."""


def offline_vllm(path: Path, dtype: str, connector: bool):
    """vLLM's offline engine as the benchmarks run it: eager, no prefix caching, its engine core in
    this process, this process's torch threads. With ``connector``, kvrelay's KV connector is attached
    as a vLLM pool attaches it (its per-layer hooks run on every forward). One per process: vLLM's
    process state allows no second engine (run it in a child, as :func:`bench_vllm_apart` does)."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = VLLM_KV_CACHE_GIB  # GiB of KV: vLLM's CPU build takes it from here only
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as in a vLLM pool's worker, where the connector lives
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # else vLLM lowers its threads to 1
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if connector:
        register_bridge("offline", Bridge(model_name=path.name))
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector=CONNECTOR_CLASS, kv_connector_module_path=
                                                    CONNECTOR_MODULE, kv_role="kv_both", engine_id="offline")
    return vllm.LLM(model=str(path), dtype=cast(Any, dtype), enforce_eager=True, max_model_len=VLLM_MAX_MODEL_LEN,
                    enable_prefix_caching=False, seed=0, **kw)


def bench_vllm(path: Path, dtype: str, prompt512: list[int], prompts: dict[int, list[list[int]]], new_tokens: int,
               repeat: int, connector: bool = False) -> tuple[float, dict[int, float]]:
    """:func:`offline_vllm` measured as :func:`bench_ours` measures whole generate calls: (prefill tok/s
    of ``prompt512``, batch -> decode tok/s); with ``connector``, requests that move no KV."""
    import vllm
    from vllm.inputs import TokensPrompt

    llm = offline_vllm(path, dtype, connector)

    def run(batch: list[list[int]], n: int) -> None:
        sp = vllm.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], sp, use_tqdm=False)

    run([prompt512], 1)  # warm-up
    prefill = len(prompt512) / _time(lambda: run([prompt512], 1), repeat)
    decode = {}
    for b, batch in prompts.items():
        run(batch, 4)
        decode[b] = b * new_tokens / _time(lambda: run(batch, new_tokens), repeat)  # noqa: B023 (called at once)
    return prefill, decode


def bench_vllm_apart(*args: Any, threads: int, connector: bool) -> tuple[float, dict[int, float]]:
    """:func:`bench_vllm` in a fresh (spawned) process with ``threads`` torch threads."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=torch.set_num_threads,
                                                initargs=(threads,)) as pool:
        return pool.submit(functools.partial(bench_vllm, connector=connector), *args).result(timeout=VLLM_TIMEOUT_S)


def _median_of(runs: list[tuple[float, dict[int, float]]]) -> tuple[float, dict[int, float]]:
    """The median over runs of each figure of :func:`bench_vllm`."""
    return (statistics.median(p for p, _ in runs),
            {b: statistics.median(d[b] for _, d in runs) for b in runs[0][1]})


def run_engine_bench(model_path: Path, dtype: str = "float32", threads: int = 2, batches: tuple[int, ...] = (1, 8, 32),
                     new_tokens: int = 64, repeat: int = 3, with_hf: bool = True,
                     with_vllm: bool = False, vllm_rounds: int = 1) -> EngineBenchResult:
    torch.set_num_threads(threads)
    eng = LLMEngine(EngineConfig(model_path=model_path, dtype=cast(DType, dtype),  # a DType: EngineConfig checks
                                 cache=CacheConfig(memory_gib=1.0),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64)))
    prompt512 = _prompts(eng.tokenizer, 1, 512)[0]
    ours_prefill, ours_decode = bench_ours(eng, prompt512, list(batches), new_tokens, repeat)
    hf_decode: dict[int, float]
    hf_prefill, hf_decode = None, {}
    if with_hf:
        hf_prefill, hf_decode = bench_hf(model_path, eng.model.dtype, eng.tokenizer, prompt512, list(batches),
                                         new_tokens, repeat)
    vllm_prefill: float | None = None
    vllm_decode: dict[int, float] = {}
    hooked_prefill: float | None = None
    hooked_decode: dict[int, float] = {}
    vllm_version = None
    if with_vllm:
        vllm_version = installed_version()
        args = (model_path, dtype, prompt512, {b: _prompts(eng.tokenizer, b, 32) for b in batches}, new_tokens, repeat)
        plain, hooked = [], []
        for _ in range(vllm_rounds):  # interleaved: a drift of the machine hits both alike
            plain.append(bench_vllm_apart(*args, threads=threads, connector=False))
            hooked.append(bench_vllm_apart(*args, threads=threads, connector=True))
        vllm_prefill, vllm_decode = _median_of(plain)
        hooked_prefill, hooked_decode = _median_of(hooked)
    copy_bw, read_bw = measure_bandwidth()
    ctx = 32 + new_tokens // 2
    step_bytes = eng.model.weight_bytes() + ctx * eng.layout.bytes_per_token
    res = EngineBenchResult(dtype=dtype, threads=threads, prefill_tokens=len(prompt512),
                            ours_prefill_tok_s=ours_prefill, hf_prefill_tok_s=hf_prefill,
                            memcpy_gb_s=copy_bw, read_gb_s=read_bw, b1_bytes_per_step=step_bytes,
                            b1_bound_tok_s=read_bw * 1e9 / step_bytes, vllm_prefill_tok_s=vllm_prefill,
                            vllm_connector_prefill_tok_s=hooked_prefill, vllm_version=vllm_version,
                            vllm_rounds=vllm_rounds if with_vllm else 0)
    for b in batches:
        res.decode[b] = {"ours": ours_decode[b][0], "ours_decode_only": ours_decode[b][1],
                         "hf": hf_decode.get(b), "vllm": vllm_decode.get(b),
                         "vllm_connector": hooked_decode.get(b)}
    return res


def format_result(r: EngineBenchResult) -> str:
    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "n/a"

    def num(v):
        return "n/a" if v is None else f"{v:,.0f}"

    lines = [f"## engine bench: SmolLM2-135M-Instruct, {r.dtype}, {r.threads} threads",
             "", "| measure | kvrelay | transformers | ratio | vLLM | ratio | vLLM + kvrelay's connector | "
             "/ vLLM |", "|---|---|---|---|---|---|---|---|",
             f"| prefill {r.prefill_tokens} tok (tok/s) | {num(r.ours_prefill_tok_s)} | {num(r.hf_prefill_tok_s)} | "
             f"{ratio(r.ours_prefill_tok_s, r.hf_prefill_tok_s)} | {num(r.vllm_prefill_tok_s)} | "
             f"{ratio(r.ours_prefill_tok_s, r.vllm_prefill_tok_s)} | {num(r.vllm_connector_prefill_tok_s)} | "
             f"{ratio(r.vllm_connector_prefill_tok_s, r.vllm_prefill_tok_s)} |"]
    for b, d in r.decode.items():
        lines.append(f"| decode batch {b} (tok/s) | {num(d['ours'])} (decode only {num(d['ours_decode_only'])}) | "
                     f"{num(d['hf'])} | {ratio(d['ours'], d['hf'])} | {num(d.get('vllm'))} | "
                     f"{ratio(d['ours'], d.get('vllm'))} | {num(d.get('vllm_connector'))} | "
                     f"{ratio(d.get('vllm_connector'), d.get('vllm'))} |")
    b1 = r.decode.get(1, {}).get("ours_decode_only")
    lines += ["", f"memory: copy {r.memcpy_gb_s:.1f} GB/s, read {r.read_gb_s:.1f} GB/s; batch-1 decode reads "
              f"{r.b1_bytes_per_step / 1e6:.0f} MB/step -> bound {r.b1_bound_tok_s:.0f} tok/s"
              + (f"; engine at {b1 / r.b1_bound_tok_s:.0%} of it" if b1 else "")]
    return "\n".join(lines)


def to_json(r: EngineBenchResult) -> str:
    return json.dumps(asdict(r), indent=2)
