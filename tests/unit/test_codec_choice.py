"""``kv_codec: auto``'s choice (router/placement/codec_choice.py): lossless while the link keeps up with the
prefill, fewer bytes where the transfer would show, the least lossy of those about equally fast."""

from __future__ import annotations

from kvrelay.kvtransfer.base import KVCodec
from kvrelay.router.placement.codec_choice import choose_codec, exposed_transfer_s, tolerance_s

FP32 = {c: c.wire_fraction(4, 16) for c in KVCodec}  # fp32 cache, 16-token blocks: int8 3.88x, int4 7.1x
ALL = list(KVCodec)
MB = 1e6


def pick(candidates, kv_bytes, gbps, compute_s, layers=30):
    return choose_codec(candidates, FP32.__getitem__, kv_bytes, gbps, compute_s, layers)


def test_a_link_that_keeps_up_stays_lossless():
    # 115 MB in 6.7 s of prefill over 200 Mbit/s (4.6 s): hidden but the last layer's share (0.15 s, 2%),
    # as measured (benchmarks/RESULTS.md: no codec changed TTFT there)
    assert pick(ALL, 115 * MB, 0.2, 6.7) is KVCodec.NONE
    assert pick(ALL, 40_000, 0.05, 0.0) is KVCodec.NONE  # a short prompt: a few ms either way


def test_a_link_that_is_the_bottleneck_gets_fewer_bytes_among_those_allowed():
    # the same prompt over 50 Mbit/s: 18 s of transfer against 6.7 s of prefill; int8 hides it (4.7 s), and
    # int4's further 0.07 s is not worth its loss (measured: TTFT int8 6.8 s, int4 6.5 s)
    assert pick(ALL, 115 * MB, 0.05, 6.7) is KVCodec.INT8
    assert pick([KVCodec.NONE, KVCodec.INT4], 115 * MB, 0.05, 6.7) is KVCodec.INT4  # the deployment's choices
    assert pick([KVCodec.NONE], 115 * MB, 0.05, 6.7) is KVCodec.NONE
    # 10x the bytes: int8 no longer hides it, int4 buys seconds
    assert pick(ALL, 1150 * MB, 0.05, 6.7) is KVCodec.INT4


def test_the_least_lossy_of_those_within_the_tolerance_wins():
    # int8 hides the transfer (30 MB at 50 Mbit/s = 4.7 s < 6.7 s), int4 too: about as fast, int8 is less lossy
    kv = 115 * MB
    assert exposed_transfer_s(kv * FP32[KVCodec.INT8], 0.05, 6.7, 30) < tolerance_s(6.7) + \
        exposed_transfer_s(kv * FP32[KVCodec.INT4], 0.05, 6.7, 30)
    assert pick([KVCodec.NONE, KVCodec.INT4, KVCodec.INT8], 60 * MB, 0.05, 6.7) is KVCodec.INT8
    assert pick([KVCodec.FP8, KVCodec.INT8], 60 * MB, 0.05, 6.7) is KVCodec.INT8  # same bytes, less loss
