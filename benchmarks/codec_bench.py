"""KV codecs' speed on one core (or on a GPU with ``--device cuda``) (issue 35's goal: encode and decode each
>= 2 GB/s per core, so a codec never throttles a 10 Gbit/s link): GB/s of
the cache's own bytes (bf16) through :func:`~kvrelay.kvtransfer.codecs.encode`
and :func:`~kvrelay.kvtransfer.codecs.decode`, on a run of SmolLM2-shaped
blocks (16 tokens, 3 KV heads of 64). Quality is not measured here (issue 35
asks for perplexity and greedy agreement: not built yet).

Run: ``python -m kvrelay.benchmarks.codec_bench [--mib N] [--device cuda] [--json F]``.
The JSON field names are stable."""

from __future__ import annotations

import argparse
import time

import torch

from kvrelay.benchmarks.machine import emit_report, machine
from kvrelay.kvtransfer.base import KVCodec
from kvrelay.kvtransfer.codecs import decode, encode, encoded_bytes

SHAPE_TAIL = (16, 3, 64)
"""A block of one plane: tokens, KV heads, head_dim (SmolLM2-135M)."""


def _best_of(fn, repeat: int, device: str) -> float:
    """Fastest of ``repeat`` calls, each waited for to its end on ``device``."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()  # warm: a first call on a GPU also compiles and allocates
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def run(mib: int, repeat: int, device: str = "cpu") -> dict:
    torch.set_num_threads(1)
    blocks = mib * 2**20 // (2 * SHAPE_TAIL[0] * SHAPE_TAIL[1] * SHAPE_TAIL[2])
    x = torch.randn(blocks, *SHAPE_TAIL, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
    nbytes = x.numel() * 2
    rows = {}
    for codec in (KVCodec.INT8, KVCodec.FP8, KVCodec.INT4):
        enc = encode(codec, x)
        rows[codec.value] = {
            "ratio_vs_bf16": nbytes / encoded_bytes(codec, tuple(x.shape), 2),
            "encode_gb_s": nbytes / _best_of(lambda c=codec: encode(c, x), repeat, device) / 1e9,
            "decode_gb_s": nbytes / _best_of(lambda e=enc: decode(e, torch.bfloat16), repeat, device) / 1e9}
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "threads": 1, "device": device, "mib": mib,
            "torch": torch.__version__, "codecs": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codec_bench", description="KV codecs: GB/s per core and ratio")
    p.add_argument("--mib", type=int, default=64, help="bf16 KV per measurement")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu", help="where the KV and the codec's work lie: cpu or cuda[:N]")
    p.add_argument("--json", help="also write the report to this file")
    args = p.parse_args(argv)
    if args.mib < 1 or args.repeat < 1:
        p.error("--mib and --repeat must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device {args.device!r}: choose cpu or cuda[:N]")
    emit_report(run(args.mib, args.repeat, args.device), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
