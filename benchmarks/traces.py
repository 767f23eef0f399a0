"""Request traces for replay: the Azure LLM inference trace (CSV) and the
Mooncake FAST'25 traces (JSONL), and the prompts that reproduce them.

A trace gives arrival times and token counts, never text. Prompts are
token ids with exactly the trace's lengths (after an explicit length
scale); for Mooncake traces every ``hash_id`` maps to one fixed block of
512 tokens (scaled), so requests sharing an id share that block and prefix
caching sees the original workload's reuse.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from kvrelay.engine.blocks import blocks_for

MOONCAKE_BLOCK_TOKENS = 512
FORMATS = ("azure", "mooncake")
SAMPLE_TRACES = Path(__file__).resolve().parent / "data"
"""The first 200 requests of the public Azure (code) and Mooncake traces,
shipped with the package for tests and ``kvrelay demo`` (see SOURCES.md there)."""
SAMPLE_AZURE = SAMPLE_TRACES / "azure_code_head200.csv"
SAMPLE_MOONCAKE = SAMPLE_TRACES / "mooncake_synthetic_head200.jsonl"


class TraceError(ValueError):
    """The trace file is unreadable or malformed; the message names the line."""


@dataclass(slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    """Seconds after the trace's first arrival."""
    input_tokens: int
    output_tokens: int
    hash_ids: list[int] = field(default_factory=list)
    """Mooncake: ids of the prompt's 512-token blocks (shared ids = shared blocks)."""


def detect_format(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        first = f.readline().strip()
    if first.startswith("{"):
        return "mooncake"
    if first.replace(" ", "").upper().startswith("TIMESTAMP,"):
        return "azure"
    raise TraceError(f"{path}: cannot tell the trace format from its first line {first[:80]!r}; "
                     "pass --format azure|mooncake")


def _positive(value, what: str, where: str, zero_ok: bool = False) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {what} must be an integer, got {value!r}") from None
    if n < (0 if zero_ok else 1):
        raise TraceError(f"{where}: {what} must be {'>= 0' if zero_ok else '>= 1'}, got {n}")
    return n


def _azure(path: Path, limit: int | None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    t0 = None
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not reader.fieldnames or not need <= {h.strip() for h in reader.fieldnames}:
            raise TraceError(f"{path}: an Azure trace needs the header TIMESTAMP,ContextTokens,GeneratedTokens")
        for line, row in enumerate(reader, start=2):
            where = f"{path}:{line}"
            row = {k.strip(): v for k, v in row.items() if k}
            try:  # 7 fractional digits: keep microseconds
                stamp = row["TIMESTAMP"].strip()
                head, _, frac = stamp.partition(".")
                t = datetime.strptime(f"{head}.{(frac + '000000')[:6]}", "%Y-%m-%d %H:%M:%S.%f").timestamp()
            except (ValueError, AttributeError):
                raise TraceError(f"{where}: TIMESTAMP {row.get('TIMESTAMP')!r} is not "
                                 "'YYYY-MM-DD HH:MM:SS.f'") from None
            t0 = t if t0 is None else t0
            out.append(TraceRequest(len(out), t - t0, _positive(row["ContextTokens"], "ContextTokens", where),
                                    _positive(row["GeneratedTokens"], "GeneratedTokens", where)))
            if limit is not None and len(out) >= limit:
                break
    return out


def _mooncake(path: Path, limit: int | None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    t0 = None
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path}:{line}"
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: expected a JSON object")
            missing = {"timestamp", "input_length", "output_length"} - set(row)
            if missing:
                raise TraceError(f"{where}: missing {', '.join(sorted(missing))}")
            ts = row["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
                raise TraceError(f"{where}: timestamp must be a non-negative number of ms, got {ts!r}")
            ids = row.get("hash_ids", [])
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            n_in = _positive(row["input_length"], "input_length", where)
            if ids and len(ids) != blocks_for(n_in, MOONCAKE_BLOCK_TOKENS):
                raise TraceError(f"{where}: {len(ids)} hash_ids for {n_in} input tokens "
                                 f"(expected {blocks_for(n_in, MOONCAKE_BLOCK_TOKENS)} blocks of "
                                 f"{MOONCAKE_BLOCK_TOKENS})")
            t0 = ts if t0 is None else t0
            out.append(TraceRequest(len(out), (ts - t0) / 1e3, n_in,
                                    _positive(row["output_length"], "output_length", where), list(ids)))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_trace(path: str | Path, fmt: str | None = None, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a trace, arrivals relative to the first."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: trace file not found")
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; expected azure or mooncake")
    reqs = _azure(path, limit) if fmt == "azure" else _mooncake(path, limit)
    if not reqs:
        raise TraceError(f"{path}: no requests")
    return reqs


@dataclass(slots=True)
class ScaledRequest:
    trace: TraceRequest
    prompt: list[int]
    max_tokens: int


def scale_lengths(reqs: list[TraceRequest], scale: float,
                  out_scale: float | None = None) -> list[tuple[int, int]]:
    """(input, output) tokens of each request after ``scale`` (outputs after
    ``out_scale`` when given), at least 1 each."""
    out_scale = scale if out_scale is None else out_scale
    return [(max(1, round(r.input_tokens * scale)), max(1, round(r.output_tokens * out_scale))) for r in reqs]


def build_prompts(reqs: list[TraceRequest], scale: float, vocab: tuple[int, int], seed: int = 0,
                  out_scale: float | None = None) -> list[ScaledRequest]:
    """Prompts with exactly the scaled lengths. Token ids are drawn from
    ``vocab`` = [low, high). Mooncake ``hash_ids`` map to fixed token blocks
    of round(512 x scale) tokens; a request's prompt is its blocks in order,
    the last one cut to length. Without hash_ids every prompt is unique."""
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * scale))
    blocks: dict[int, list[int]] = {}
    lo, hi = vocab
    out = []
    for r, (n_in, n_out) in zip(reqs, scale_lengths(reqs, scale, out_scale)):
        if r.hash_ids:
            prompt: list[int] = []
            for h in r.hash_ids:
                if h not in blocks:
                    rng = random.Random(f"{seed}-block-{h}")
                    blocks[h] = [rng.randrange(lo, hi) for _ in range(block)]
                prompt += blocks[h]
            prompt = prompt[:n_in]
            if len(prompt) < n_in:  # scaled blocks can round short of the scaled length
                rng = random.Random(f"{seed}-tail-{r.index}")
                prompt += [rng.randrange(lo, hi) for _ in range(n_in - len(prompt))]
        else:
            rng = random.Random(f"{seed}-req-{r.index}")
            prompt = [rng.randrange(lo, hi) for _ in range(n_in)]
        out.append(ScaledRequest(r, prompt, n_out))
    return out
