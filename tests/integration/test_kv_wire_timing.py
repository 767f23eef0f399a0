"""Every TCP transfer is timed on the wire for the router's link estimate
(router/placement/link_estimate.py): bytes, first byte written to the
receiver's ack, the connection's least RTT, and whether the network set the
pace. On loopback nothing holds a connection back but the sender and the
receiver, so no transfer here is link-bound: their rates are lower bounds. A
link that is (a tbf-shaped WAN) is tests/integration/test_cities.py's."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvrelay.benchmarks.kv_peer import SECRET
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import TransferState, TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.local import LocalKVSender
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from kvrelay.router.placement.link_estimate import LinkSample
from tests.integration.test_kv_tcp import make_cache

LAYOUT = KVLayout("m", "float32", 4, 2, 64, 16)


def _send(tx, rx, src: KVCache, tid: str, blocks: list[int], gap_s: float = 0.0):
    rh = rx.expect(tid, blocks)
    h = tx.open(TransferTarget(rx.endpoint, tid, tuple(blocks), LAYOUT.compat_hash()))
    for layer in range(LAYOUT.num_layers):
        h.send_layer(layer, blocks, 0)
        time.sleep(gap_s)  # a prefill that produces a layer every gap_s
    h.finish(1, 0.0)
    assert h.wait(60) is TransferState.DONE and rh.wait(60) is TransferState.DONE, (h.failure(), rh.failure())
    rx.cancel(tid)
    return h.result()


def _gbps(res) -> float:
    """The rate the router takes from a transfer's figures (as the prefill worker reports them)."""
    return LinkSample.of(0.0, res.nbytes, res.wire_s * 1e3, res.rtt_s * 1e3, res.link_bound,
                         busy_ms=res.busy_s * 1e3).gbps


def test_tcp_transfers_are_timed_on_the_wire():
    src, dst = make_cache(LAYOUT, 256, 1), make_cache(LAYOUT, 256, None)
    cfg = TransferConfig(secret=SECRET, streams=1)
    rx, tx = TcpKVReceiver(dst, cfg=cfg), TcpKVSender(src, cfg)
    try:
        blocks = list(range(256))  # 8 MiB of fp32 KV at once: the sender, not the link, sets the pace
        t0 = time.perf_counter()
        bulk = _send(tx, rx, src, "bulk", blocks)
        elapsed = time.perf_counter() - t0
        assert bulk.nbytes >= 256 * LAYOUT.block_bytes
        assert 0 < bulk.wire_s <= elapsed and 0 < bulk.rtt_s < 0.05, bulk
        assert not bulk.link_bound, bulk  # loopback: no network holds the connection back
        assert _gbps(bulk) == pytest.approx(bulk.nbytes * 8 / (bulk.wire_s - bulk.rtt_s) / 1e9)

        # a slow producer: the wire waits for it, so the transfer's rate is far below what the
        # same connection just moved (a lower bound of the link's, and marked so)
        slow = _send(tx, rx, src, "slow", blocks[:8], gap_s=0.1)
        assert slow.wire_s >= 0.3 and not slow.link_bound, slow
        assert _gbps(slow) <= slow.nbytes * 8 / 0.3 / 1e9, slow
    finally:
        tx.close()
        rx.close()


def test_a_transfer_the_receiver_pulls_is_not_timed():
    """Shared memory: frames carry block ids, the receiver copies; no wire time to report."""
    shm = f"/dev/shm/kvrelay-test-timing-{os.getpid()}"
    src, dst = KVCache(LAYOUT, 16, shm_path=shm), make_cache(LAYOUT, 16, None)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(0)))
    cfg = TransferConfig(secret=SECRET, protection="integrity")
    rx, tx = TcpKVReceiver(dst, cfg=cfg), LocalKVSender(src, cfg)
    try:
        res = _send(tx, rx, src, "pulled", list(range(16)))
        assert (res.wire_s, res.link_bound, _gbps(res)) == (0.0, False, 0.0), res
    finally:
        tx.close()
        rx.close()
        src.unlink()
