"""KV in CUDA memory through kvrelay's transports (kvtransfer/staging.py):
sealed TCP frames staged through pinned host buffers in both directions,
between two CUDA caches and between a CUDA cache and a host one; NIXL
reading VRAM into VRAM with the MACs checked over host copies; a
shared-memory sender into a CUDA receiver; and the ordering promise, that
a layer's blocks are copied out only after the writes the engine enqueued
before ``send_layer`` completed. Skipped without CUDA (tests/conftest.py);
``make gpu-check`` runs them on a GPU host."""

from __future__ import annotations

import os

import pytest
import torch

from kvrelay.benchmarks.kv_peer import SECRET
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import KVCodec, TransferState, TransferTarget
from kvrelay.kvtransfer.codecs import decode, encode
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.local import LocalKVSender
from kvrelay.kvtransfer.nixl import NixlKVReceiver, NixlKVSender, nixl_available
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender

pytestmark = pytest.mark.gpu

LAYOUT = KVLayout("m", "bfloat16", 4, 2, 64, 16)
SRC_BLOCKS = [3, 4, 5, 9, 0, 17]
DST_BLOCKS = [10, 11, 2, 3, 4, 20]


def filled(device: str, blocks: int, seed: int) -> KVCache:
    cache = KVCache(LAYOUT, blocks, device=device)
    gen = torch.Generator().manual_seed(seed)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen).to(cache.kv.dtype))
    return cache


def run_transfer(tx, rx, src: KVCache, tid: str, protection: str = "aead", before_send=None):
    """One transfer of SRC_BLOCKS into DST_BLOCKS, every layer; its send handle."""
    rh = rx.expect(tid, DST_BLOCKS)
    h = tx.open(TransferTarget(rx.endpoint, tid, tuple(DST_BLOCKS), LAYOUT.compat_hash(), protection=protection))
    for layer in range(LAYOUT.num_layers):
        if before_send is not None:
            before_send(layer)
        h.send_layer(layer, SRC_BLOCKS, 0)
    h.finish(5, -0.25)
    assert rh.wait(60) is TransferState.DONE, rh.failure()
    assert h.wait(60) is TransferState.DONE, h.failure()
    assert rh.result().first_token_id == 5
    return h


def same_blocks(src: KVCache, dst: KVCache) -> bool:
    return torch.equal(dst.kv[:, :, DST_BLOCKS].cpu(), src.kv[:, :, SRC_BLOCKS].cpu())


@pytest.mark.parametrize("protection", ["aead", "integrity"])
@pytest.mark.parametrize("devices", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_tcp_moves_kv_to_and_from_cuda_memory(devices, protection):
    src, dst = filled(devices[0], 24, 1), KVCache(LAYOUT, 24, device=devices[1])
    cfg = TransferConfig(secret=SECRET, streams=2, protection=protection)
    rx, tx = TcpKVReceiver(dst, cfg=cfg), TcpKVSender(src, cfg)
    try:
        run_transfer(tx, rx, src, "t", protection)
    finally:
        tx.close()
        rx.close()
    assert same_blocks(src, dst)
    untouched = [b for b in range(24) if b not in DST_BLOCKS]
    assert not dst.kv[:, :, untouched].any()


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("devices", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_a_coded_transfer_moves_kv_from_and_into_cuda_memory(devices, codec):
    """Under a codec the sender encodes the staged host copies, the receiver decodes into VRAM: what
    lands is exactly what the codec decodes (tests/integration/test_kv_codec_transfer.py on host memory)."""
    src, dst = filled(devices[0], 24, 3), KVCache(LAYOUT, 24, device=devices[1])
    cfg = TransferConfig(secret=SECRET, streams=2, codec=codec)
    rx, tx = TcpKVReceiver(dst, cfg=cfg), TcpKVSender(src, cfg)
    try:
        h = run_transfer(tx, rx, src, "t")
    finally:
        tx.close()
        rx.close()
    for layer in range(LAYOUT.num_layers):
        for kind in range(2):
            x = src.kv[layer, kind, SRC_BLOCKS].cpu()
            want = decode(encode(KVCodec(codec), x), x.dtype)
            assert torch.equal(dst.kv[layer, kind, DST_BLOCKS].cpu(), want), (layer, kind)
    assert h.result().nbytes < LAYOUT.bytes_per_block * len(SRC_BLOCKS) / 1.8


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_layer_leaves_only_after_the_writes_enqueued_before_send_layer(codec):
    """Each layer's blocks are rewritten on the current stream behind a long GPU sleep, then sent at
    once: what arrives is the rewritten value (the copy waited for the engine's stream), coded or not."""
    src, dst = filled("cuda", 24, 2), KVCache(LAYOUT, 24, device="cuda")
    cfg = TransferConfig(secret=SECRET, streams=1, codec=codec)
    rx, tx = TcpKVReceiver(dst, cfg=cfg), TcpKVSender(src, cfg)

    def rewrite(layer: int) -> None:
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the writes below run
        src.kv[layer, :, SRC_BLOCKS] = float(layer + 1)
    try:
        run_transfer(tx, rx, src, "t", before_send=rewrite)
    finally:
        tx.close()
        rx.close()
    for layer in range(LAYOUT.num_layers):
        assert torch.all(dst.kv[layer, :, DST_BLOCKS] == float(layer + 1)), layer


@pytest.mark.skipif(not nixl_available(), reason="nixl does not import")
def test_nixl_reads_vram_into_vram_and_checks_it_over_host_copies():
    os.environ.setdefault("UCX_MODULES", "^ib")
    src, dst = filled("cuda", 24, 3), KVCache(LAYOUT, 24, device="cuda")
    rx = NixlKVReceiver(dst, cfg=TransferConfig(secret=SECRET, protection="integrity"))
    tx = NixlKVSender(src, TransferConfig(secret=SECRET))
    try:
        h = run_transfer(tx, rx, src, "t", "integrity")
        assert all(s.shared for s in h.pool.streams if s.sock is not None), "the bytes went on the socket"
    finally:
        tx.close()
        rx.close()
    assert same_blocks(src, dst)


def test_a_shared_memory_sender_fills_a_cuda_receiver():
    shm = f"/dev/shm/kvrelay-cuda-test-{os.getpid()}"
    src = KVCache(LAYOUT, 24, shm_path=shm)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(4)).to(src.kv.dtype))
    dst = KVCache(LAYOUT, 24, device="cuda")
    rx = TcpKVReceiver(dst, cfg=TransferConfig(secret=SECRET, protection="integrity"))
    tx = LocalKVSender(src, TransferConfig(secret=SECRET))
    try:
        run_transfer(tx, rx, src, "t")
    finally:
        tx.close()
        rx.close()
        src.unlink()
    assert same_blocks(src, dst)
