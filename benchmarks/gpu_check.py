"""``make gpu-check``'s figures: KV moved from and to CUDA memory through
kvrelay's transports, on a GPU host (issue 34, item 5).

- ``staging``: one call of :class:`~kvrelay.kvtransfer.staging.DeviceKV`
  copying a whole cache device-to-host (``stage``) and host-to-device
  (``land``), in GB/s;
- ``tcp``: one transfer of every layer of a cache's blocks on loopback,
  sealed (aead) and MAC'd (integrity), from CUDA to CUDA against the same
  from host to host, in GB/s, so the staging's cost is a ratio measured in
  the same run;
- ``tcp_coded``: the same from CUDA to CUDA under the int8 and int4 KV codecs
  (encoded on the sender's copy stream, decoded on the receiver's device), in
  GB/s of the cache's bytes (what crossed is 1.94x or 3.56x fewer);
- ``nixl``: VRAM read into VRAM by NIXL (integrity), where nixl imports.

The layout is a Llama-3-8B-like one (32 layers, 8 KV heads of 128, bf16,
16-token blocks). Run: ``python -m kvrelay.benchmarks.gpu_check --json F``
(refuses without CUDA). The JSON field names are stable."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvrelay.benchmarks.kv_peer import SECRET
from kvrelay.benchmarks.machine import emit_report, machine
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import KVCodec, TransferState, TransferTarget
from kvrelay.kvtransfer.codecs import decode, encode
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.nixl import NixlKVReceiver, NixlKVSender, nixl_available
from kvrelay.kvtransfer.protection import Protection
from kvrelay.kvtransfer.staging import DeviceKV
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender

LAYOUT = KVLayout("llama-3-8b-like", "bfloat16", 32, 8, 128, 16)
TIMEOUT_S = 120.0


def staging(mib: int) -> dict:
    blocks = max(1, mib * 2**20 // LAYOUT.bytes_per_block)
    mem = DeviceKV(KVCache(LAYOUT, blocks, device="cuda"))
    ids, layers = list(range(blocks)), range(LAYOUT.num_layers)
    nbytes = blocks * LAYOUT.bytes_per_block
    mem.stage(layers, ids).views([nbytes])  # warm: pinned memory allocated once
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mem.stage(layers, ids).views([nbytes])
    d2h = time.perf_counter() - t0
    landing = mem.landing(layers, ids)
    t0 = time.perf_counter()
    mem.land(landing)
    h2d = time.perf_counter() - t0
    return {"bytes": nbytes, "d2h_gb_s": nbytes / d2h / 1e9, "h2d_gb_s": nbytes / h2d / 1e9}


def _transfer(device: str, mib: int, protection: str, transport: str = "tcp", codec: str = "none") -> float:
    """GB/s of KV (the cache's bytes, whatever crossed) of one transfer of every layer of ``mib`` MiB of blocks
    from ``device`` to ``device``."""
    blocks = max(1, mib * 2**20 // LAYOUT.bytes_per_block)
    src, dst = KVCache(LAYOUT, blocks, device=device), KVCache(LAYOUT, blocks, device=device)
    src.kv.normal_()
    cfg = TransferConfig(secret=SECRET, streams=2, protection=Protection(protection), codec=KVCodec(codec))
    rx_cls, tx_cls = (NixlKVReceiver, NixlKVSender) if transport == "nixl" else (TcpKVReceiver, TcpKVSender)
    rx, tx = rx_cls(dst, cfg=cfg), tx_cls(src, cfg)
    ids = list(range(blocks))
    try:
        rh = rx.expect("t", ids)
        t0 = time.perf_counter()
        h = tx.open(TransferTarget(rx.endpoint, "t", tuple(ids), LAYOUT.compat_hash(), protection=protection))
        for layer in range(LAYOUT.num_layers):
            h.send_layer(layer, ids, 0)
        h.finish(0, 0.0)
        if rh.wait(TIMEOUT_S) is not TransferState.DONE or h.wait(TIMEOUT_S) is not TransferState.DONE:
            raise RuntimeError(f"{transport} transfer on {device} failed: {rh.failure() or h.failure()}")
        dt = time.perf_counter() - t0
    finally:
        tx.close()
        rx.close()
    if not _landed_as_sent(src, dst, KVCodec(codec)):
        raise RuntimeError(f"{transport} transfer on {device}: the received KV differs from the sent ({codec})")
    return blocks * LAYOUT.bytes_per_block / dt / 1e9


def _landed_as_sent(src: KVCache, dst: KVCache, codec: KVCodec) -> bool:
    """Whether ``dst`` holds ``src``'s KV, as ``codec`` decodes it."""
    if codec is KVCodec.NONE:
        return torch.equal(src.kv, dst.kv)
    return all(torch.equal(dst.kv[layer, kind], decode(encode(codec, src.kv[layer, kind]), src.kv.dtype))
               for layer in range(LAYOUT.num_layers) for kind in range(2))


def run(mib: int) -> dict:
    tcp = {f"{dev}_{prot}_gb_s": _transfer(dev, mib, prot) for dev in ("cuda", "cpu") for prot in ("aead", "integrity")}
    coded = {f"cuda_{codec}_{prot}_gb_s": _transfer("cuda", mib, prot, codec=codec)
             for codec in ("int8", "int4") for prot in ("aead", "integrity")}
    nixl = None
    if nixl_available():
        os.environ.setdefault("UCX_MODULES", "^ib")
        nixl = {"cuda_integrity_gb_s": _transfer("cuda", mib, "integrity", "nixl")}
    return {"machine": machine(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "layout": LAYOUT.model, "mib": mib, "staging": staging(mib),
            "tcp": tcp, "tcp_coded": coded, "nixl": nixl}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description="KV from and to CUDA memory: figures")
    p.add_argument("--mib", type=int, default=512, help="KV per measurement (MiB)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    emit_report(run(args.mib), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
