"""KV codecs on the TCP transport (kvtransfer/coded.py): what lands is exactly
what the codec decodes, fewer bytes cross, a frame whose codec lies or whose
scales were altered in flight is refused before a byte of it lands, and a
receiver that cannot decode a codec refuses it in the handshake. The codecs'
error against a real model's KV: tests/unit/test_kv_codecs.py."""

from __future__ import annotations

import pytest
import torch

from kvrelay.benchmarks.kv_peer import SECRET
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import KVCodec, TransferState, TransferTarget
from kvrelay.kvtransfer.channel import SendStream
from kvrelay.kvtransfer.codecs import decode, encode
from kvrelay.kvtransfer.coded import coded_bytes
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from tests.integration.test_kv_tcp import make_cache, transfer

LAYOUT = KVLayout("m", "bfloat16", 3, 2, 64, 16)
SRC = [3, 4, 5, 9, 0, 17, 18, 19, 20, 21, 22]  # runs of 3, 1, 1 and 6 blocks: frames cut across scale groups
DST = [10, 11, 2, 3, 4, 20, 30, 31, 32, 33, 34]


def _decoded(codec: str, x: torch.Tensor) -> torch.Tensor:
    return x if codec == "none" else decode(encode(KVCodec(codec), x), x.dtype)


@pytest.mark.parametrize("protection", ["aead", "integrity"])
@pytest.mark.parametrize("codec", ["int8", "fp8", "int4", "none"])
def test_a_coded_transfer_lands_what_the_codec_decodes_and_sends_fewer_bytes(codec, protection):
    src, dst = make_cache(LAYOUT, 32, 1), make_cache(LAYOUT, 40, None)
    cfg = TransferConfig(secret=SECRET, streams=2, codec=codec, protection=protection)
    h, rh, _ = transfer(src, dst, SRC, DST, cfg=cfg)
    assert h.poll() is TransferState.DONE and rh.poll() is TransferState.DONE, (h.failure(), rh.failure())
    for layer in range(LAYOUT.num_layers):  # each layer is its own frame (sent one at a time here)
        for kind in range(2):
            assert torch.equal(dst.kv[layer, kind, DST], _decoded(codec, src.kv[layer, kind, SRC])), (layer, kind)
    assert not dst.kv[:, :, [b for b in range(40) if b not in DST]].any()
    plain = LAYOUT.bytes_per_block * len(SRC)
    assert rh.result().nbytes == plain  # the receiver counts the KV that landed
    # the sender counts what crossed: frames may merge layers, so bound it by one frame per layer and all in one
    wire = h.result().nbytes
    per_layer = LAYOUT.num_layers * coded_bytes(KVCodec(codec), LAYOUT, len(SRC), 1)
    assert min(per_layer, coded_bytes(KVCodec(codec), LAYOUT, len(SRC), LAYOUT.num_layers)) <= wire <= per_layer
    if codec != "none":
        assert wire < plain / 1.8


@pytest.mark.parametrize("lie", ["fp8", "", "zstd"])
def test_a_frame_whose_codec_lies_is_refused(lie, monkeypatch):
    """The sealed header names another codec than the connection agreed on (none, another, an unknown
    one): the receiver refuses the frame and nothing of it lands."""
    monkeypatch.setattr(SendStream, "_header_codec", lambda self: lie)
    src, dst = make_cache(LAYOUT, 32, 1), make_cache(LAYOUT, 40, None)
    h, rh, _ = transfer(src, dst, SRC, DST, cfg=TransferConfig(secret=SECRET, streams=1, codec="int8"),
                        timeout=20, rx_timeout=5)
    assert h.poll() is TransferState.FAILED and rh.poll() is TransferState.FAILED
    assert "codec" in rh.failure().reason, rh.failure().reason
    assert not dst.kv.any()


@pytest.mark.parametrize("protection", ["aead", "integrity"])
def test_scales_altered_in_flight_fail_authentication_and_nothing_lands(protection):
    """Fault injection flips the first sealed payload byte of the first frame: under a codec that is a
    scale (scales travel first). The record fails authentication; the frame was opened into a buffer, so
    no block of the cache was written; the next transfer on the same sender lands."""
    src, dst = make_cache(LAYOUT, 32, 1), make_cache(LAYOUT, 40, None)
    rx = TcpKVReceiver(dst, cfg=TransferConfig(secret=SECRET, protection=protection))
    tx = TcpKVSender(src, TransferConfig(secret=SECRET, streams=1, codec="int8", protection=protection,
                                         corrupt_first=1))
    try:
        for tid, ok in (("t", False), ("t2", True)):
            rh = rx.expect(tid, DST)
            h = tx.open(TransferTarget(rx.endpoint, tid, tuple(DST), LAYOUT.compat_hash()))
            for layer in range(LAYOUT.num_layers):
                h.send_layer(layer, SRC, 0)
            h.finish(1, 0.0)
            assert h.wait(20) is (TransferState.DONE if ok else TransferState.FAILED), h.failure()
            assert rh.wait(10) is (TransferState.DONE if ok else TransferState.FAILED), rh.failure()
            if not ok:
                assert "authentication" in rh.failure().reason, rh.failure().reason
                assert not dst.kv.any()
            rx.cancel(tid)
        assert torch.equal(dst.kv[0, 0, DST], _decoded("int8", src.kv[0, 0, SRC]))
    finally:
        tx.close()
        rx.close()


def test_a_receiver_refuses_a_codec_its_cache_cannot_take_and_a_sender_an_unknown_one():
    """A cache of one page per block (vLLM's layout) cannot be decoded into: the handshake refuses int8
    naming it. An unknown codec in a target fails that transfer naming it, before any connection."""
    paged = KVLayout("m", "bfloat16", 3, 2, 64, 16, kinds=1, format="vllm-cpu-test")
    src = KVCache.wrap(paged, torch.ones(3, 1, 8, 2 * 16 * 2 * 64, dtype=torch.bfloat16))
    dst = KVCache.wrap(paged, torch.zeros(3, 1, 8, 2 * 16 * 2 * 64, dtype=torch.bfloat16))
    h, _, _ = transfer(src, dst, [0, 1], [2, 3], cfg=TransferConfig(secret=SECRET, streams=1, codec="int8"),
                        timeout=20, rx_timeout=1)
    assert h.poll() is TransferState.FAILED and "KV codec int8 refused" in h.failure().reason, h.failure()
    assert not dst.kv.any()
    tx = TcpKVSender(make_cache(LAYOUT, 4, 1), TransferConfig(secret=SECRET))
    try:
        bad = tx.open(TransferTarget("127.0.0.1:9", "t", (0,), LAYOUT.compat_hash(), codec="zstd"))
        assert bad.poll() is TransferState.FAILED and "unknown KV codec 'zstd'" in bad.failure().reason
    finally:
        tx.close()


@pytest.mark.parametrize("dtype,element", [("bfloat16", 2), ("float32", 4)])
@pytest.mark.parametrize("codec", ["none", "int8", "fp8", "int4"])
def test_the_placements_byte_fraction_is_what_a_frame_carries(codec, dtype, element):
    """KVCodec.wire_fraction (what placement prices a coded link at, without torch) against the payload of a
    frame of 64 blocks (whole scale groups): equal."""
    layout = KVLayout("m", dtype, 3, 2, 64, 16)
    plain = layout.bytes_per_block * 64  # every layer, K and V
    fraction = KVCodec(codec).wire_fraction(element, 16)
    assert coded_bytes(KVCodec(codec), layout, 64, 3) == pytest.approx(plain * fraction, rel=1e-9)
