"""The TCP KV transport on loopback: integrity under both protections,
handshake refusals, limits before trust, and a peer killed mid-transfer
(an attacker on the path: tests/integration/test_kv_mitm.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.benchmarks.kv_peer import SECRET
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import TransferState, TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.local import LocalKVSender
from kvrelay.kvtransfer.nixl import NixlKVReceiver, NixlKVSender
from kvrelay.kvtransfer.protection import Protection
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from kvrelay.kvtransfer.wire import PROTOCOL_VERSION, recv_frame, send_frame
from kvrelay.v1 import kv_wire_pb2 as pb
from tests.integration.helpers import wait_until
from tests.integration.kv_tap import CuttableLink

CFG = TransferConfig(secret=SECRET, streams=2)


def make_cache(layout: KVLayout, blocks: int, seed: int | None) -> KVCache:
    cache = KVCache(layout, blocks)
    if seed is not None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)).to(cache.kv.dtype))
    return cache


def transfer(src: KVCache, dst: KVCache, src_blocks, dst_blocks, cfg=CFG, rx_cfg=None, layers=None,
             timeout=60.0, rx_timeout: float | None = None):
    """``rx_timeout`` (default ``timeout``): how long the receiver waits once the sender is done,
    short where a refused transfer is expected never to complete."""
    rx = TcpKVReceiver(dst, cfg=rx_cfg or cfg)
    tx = TcpKVSender(src, cfg)
    try:
        rh = rx.expect("t", list(dst_blocks))
        h = tx.open(TransferTarget(rx.endpoint, "t", tuple(dst_blocks), src.layout.compat_hash()))
        for layer in layers if layers is not None else range(src.layout.num_layers):
            h.send_layer(layer, list(src_blocks), 0)
        h.finish(7, -0.5)
        h.wait(timeout)
        rh.wait(timeout if rx_timeout is None else rx_timeout)
        return h, rh, rx
    finally:
        tx.close()
        rx.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 4), heads=st.integers(1, 4), dim=st.sampled_from([8, 16, 64]),
       bs=st.sampled_from([1, 4, 16]), dtype=st.sampled_from(["float32", "bfloat16"]),
       data=st.data(), streams=st.integers(1, 3))
def test_received_bytes_equal_sent_bytes(layers, heads, dim, bs, dtype, data, streams):
    layout = KVLayout("m", dtype, layers, heads, dim, bs)
    n = data.draw(st.integers(1, 24))
    src_blocks = data.draw(st.lists(st.integers(0, 31), min_size=n, max_size=n, unique=True))
    dst_blocks = data.draw(st.lists(st.integers(0, 39), min_size=n, max_size=n, unique=True))
    src, dst = make_cache(layout, 32, 1), make_cache(layout, 40, None)
    h, rh, _ = transfer(src, dst, src_blocks, dst_blocks, cfg=TransferConfig(secret=SECRET, streams=streams))
    assert h.poll() is TransferState.DONE and rh.poll() is TransferState.DONE, (h.failure(), rh.failure())
    assert rh.result().first_token_id == 7
    assert torch.equal(dst.kv[:, :, dst_blocks], src.kv[:, :, src_blocks])
    untouched = [b for b in range(40) if b not in dst_blocks]
    assert not dst.kv[:, :, untouched].any()


@pytest.mark.parametrize("transport", ["local", "nixl"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(["float32", "bfloat16"]), data=st.data())
def test_pulled_transport_integrity(transport, dtype, data):
    """local and nixl: the receiver pulls the sender's blocks; no KV bytes on the
    socket. NIXL bytes cross the fabric as they are, so only on an integrity link;
    on an aead one (the default) the receiver declines and they arrive sealed."""
    layout = KVLayout("m", dtype, 3, 2, 16, 4)
    n = data.draw(st.integers(1, 20))
    src_blocks = data.draw(st.lists(st.integers(0, 23), min_size=n, max_size=n, unique=True))
    dst_blocks = data.draw(st.lists(st.integers(0, 29), min_size=n, max_size=n, unique=True))
    shm = f"/dev/shm/kvrelay-test-{os.getpid()}" if transport == "local" else None
    src, dst = KVCache(layout, 24, shm_path=shm), make_cache(layout, 30, None)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(n)).to(src.kv.dtype))
    rx_cfg = TransferConfig(secret=SECRET, protection="integrity")  # the least it requires
    rx = (NixlKVReceiver if transport == "nixl" else TcpKVReceiver)(dst, cfg=rx_cfg)
    tx = (NixlKVSender if transport == "nixl" else LocalKVSender)(src, CFG)
    try:
        for tid, protection in (("t", "integrity"), ("t2", "aead")):
            rh = rx.expect(tid, dst_blocks)
            h = tx.open(TransferTarget(rx.endpoint, tid, tuple(dst_blocks), layout.compat_hash(),
                                       protection=protection))
            for layer in range(3):
                h.send_layer(layer, src_blocks, 0)
            h.finish(3, 0.0)
            assert rh.wait(30) is TransferState.DONE, rh.failure()
            assert h.wait(30) is TransferState.DONE, h.failure()
            pulled = transport == "local" or protection == "integrity"
            assert all(s.shared is pulled for s in h.pool.streams if s.sock is not None), (transport, protection)
            assert torch.equal(dst.kv[:, :, dst_blocks], src.kv[:, :, src_blocks])
            rx.cancel(tid)
            dst.kv.zero_()
    finally:
        tx.close()
        rx.close()
        src.unlink()




@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(["float32", "bfloat16"]), data=st.data(), streams=st.integers(1, 3),
       protection=st.sampled_from(list(Protection)))
def test_protected_transfer_integrity(dtype, data, streams, protection):
    layout = KVLayout("m", dtype, 3, 2, 16, 4)
    n = data.draw(st.integers(1, 20))
    src_blocks = data.draw(st.lists(st.integers(0, 23), min_size=n, max_size=n, unique=True))
    dst_blocks = data.draw(st.lists(st.integers(0, 29), min_size=n, max_size=n, unique=True))
    src, dst = make_cache(layout, 24, n), make_cache(layout, 30, None)
    cfg = TransferConfig(secret=SECRET, streams=streams, protection=protection)
    h, rh, _ = transfer(src, dst, src_blocks, dst_blocks, cfg=cfg)
    assert rh.poll() is TransferState.DONE and h.poll() is TransferState.DONE, (rh.failure(), h.failure())
    assert torch.equal(dst.kv[:, :, dst_blocks], src.kv[:, :, src_blocks])


def test_receiver_requiring_aead_refuses_an_integrity_only_sender():
    src, dst = make_cache(LAYOUT, 8, 1), make_cache(LAYOUT, 8, None)
    h, _rh, _ = transfer(src, dst, [0, 1], [2, 3], cfg=TransferConfig(secret=SECRET, streams=1, protection="integrity"),
                        rx_cfg=TransferConfig(secret=SECRET), timeout=5, rx_timeout=0.2)
    assert h.poll() is TransferState.FAILED and "requires aead protection" in h.failure().reason
    assert not dst.kv.any()


def test_256_mib_transfer_integrity():
    layout = KVLayout("m", "float32", 2, 8, 128, 16)  # 64 KiB per (layer, K/V, block)
    n = 1024  # 2 layers x 2 x 1024 x 64 KiB = 256 MiB
    src, dst = make_cache(layout, n, 3), make_cache(layout, n, None)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    h, rh, _ = transfer(src, dst, list(range(n)), perm, cfg=TransferConfig(secret=SECRET, streams=4), timeout=120)
    assert rh.poll() is TransferState.DONE, rh.failure()
    assert h.result().nbytes == 256 << 20
    assert torch.equal(dst.kv[:, :, perm], src.kv)


LAYOUT = KVLayout("m", "float32", 2, 2, 16, 4)


def test_layout_mismatch_refused_before_any_byte():
    other = KVLayout("m", "float32", 2, 2, 16, 8)
    src, dst = make_cache(LAYOUT, 8, 1), make_cache(other, 8, None)
    rx = TcpKVReceiver(dst, cfg=CFG)
    tx = TcpKVSender(src, CFG)
    try:
        rh = rx.expect("t", [0, 1])
        # The sender checks the target's layout hash itself...
        h = tx.open(TransferTarget(rx.endpoint, "t", (0, 1), other.compat_hash()))
        assert h.poll() is TransferState.FAILED and "layout" in h.failure().reason
        # ...and the receiver refuses a sender that claims otherwise.
        h = tx.open(TransferTarget(rx.endpoint, "t2", (0, 1), LAYOUT.compat_hash()))
        h.send_layer(0, [0, 1], 0)
        h.finish(1, 0.0)
        assert h.wait(10) is TransferState.FAILED
        assert "KV layout mismatch" in h.failure().reason
        assert rh.poll() is TransferState.WAITING
        assert wait_until(lambda: rx.refused == 1, 5)
        assert not dst.kv.any()
    finally:
        tx.close()
        rx.close()


def test_wrong_secret_refused_before_any_byte():
    src, dst = make_cache(LAYOUT, 8, 1), make_cache(LAYOUT, 8, None)
    h, rh, rx = transfer(src, dst, [0, 1], [2, 3], cfg=TransferConfig(secret=b"wrong", streams=1), rx_cfg=CFG,
                         timeout=5, rx_timeout=0.2)
    assert h.poll() is TransferState.FAILED and "authentication" in h.failure().reason
    assert rh.poll() is TransferState.FAILED  # never completed; timed out waiting
    assert wait_until(lambda: rx.refused >= 1, 5)
    assert not dst.kv.any()


def test_wrong_protocol_version_refused():
    dst = make_cache(LAYOUT, 8, None)
    rx = TcpKVReceiver(dst, cfg=CFG)
    try:
        host, port = rx.endpoint.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            send_frame(s, pb.KVFrame(hello=pb.KVHello(protocol_version=99, layout_hash=LAYOUT.compat_hash(),
                                                      nonce=b"x" * 32)))
            answer = pb.KVHelloAnswer.FromString(recv_frame(s)[0].hello_ack.answer)
        assert not answer.accepted and "protocol version 99 unsupported" in answer.reason
    finally:
        rx.close()


def _peer(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvrelay.benchmarks.kv_peer", *args], stdout=subprocess.PIPE,
                            text=True)


def test_sender_killed_mid_transfer_fails_receiver_promptly():
    spec = "float32,2,8,128,16,64"
    layout = KVLayout("peer", "float32", 2, 8, 128, 16)
    dst = make_cache(layout, 64, None)
    rx = TcpKVReceiver(dst, cfg=CFG)
    rh = rx.expect("t", list(range(64)))
    peer = _peer("sender", spec, rx.endpoint, "t", "64", "1")  # sends 1 of 2 layers, never finishes
    try:
        assert peer.stdout.readline().strip() == "SENT"
        assert rh.poll() is TransferState.TRANSFERRING
        peer.kill()
        t0 = time.monotonic()
        assert rh.wait(10.0) is TransferState.FAILED
        assert time.monotonic() - t0 < 5.0  # the lost connection, not a stall timeout (30 s)
        assert "connection from the sender lost" in rh.failure().reason and "truncated" in rh.failure().reason
    finally:
        peer.kill()
        peer.wait()
        rx.close()


def test_receiver_killed_mid_transfer_fails_sender_promptly():
    layout = KVLayout("peer", "float32", 2, 8, 128, 16)
    n = 2048  # 256 MiB: long enough to kill the receiver in the middle
    src = make_cache(layout, n, 1)
    peer = _peer("receiver", f"float32,2,8,128,16,{n}", "1")
    tx = TcpKVSender(src, TransferConfig(secret=SECRET, streams=1))
    try:
        endpoint = peer.stdout.readline().split()[1]
        h = tx.open(TransferTarget(endpoint, "t0", tuple(range(n)), layout.compat_hash()))
        h.send_layer(0, list(range(n)), 0)
        deadline = time.monotonic() + 30
        while h.nbytes == 0 and time.monotonic() < deadline:  # layer 0 went; layer 1 cannot arrive
            time.sleep(0.005)
        peer.kill()
        h.send_layer(1, list(range(n)), 0)
        h.finish(1, 0.0)
        assert h.wait(5.0) is TransferState.FAILED
        assert "connection" in h.failure().reason
    finally:
        peer.kill()
        peer.wait()
        tx.close()


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """The receiver closed ``sock`` (EOF or reset) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset
        pass
    return True


def test_a_connection_stuck_in_a_failed_transfer_is_retired_and_the_next_transfer_goes_through():
    """The link carrying a transfer is cut mid-frame; the transfer fails (its
    request re-placed, as the router does); the link comes back, but the old
    connection stays dead (TCP's backoff after a long cut). The next transfer
    to that receiver must not queue behind the dead connection: the failed
    transfer's connection was retired when it failed, and the next one
    connects afresh (before, it waited for the kernel's stall timeout)."""
    layout = KVLayout("m", "float32", 8, 4, 64, 16)  # 16 KiB per block and layer, K and V: 16 MiB for 64 blocks
    src, dst = make_cache(layout, 64, 3), make_cache(layout, 128, None)
    cfg = TransferConfig(secret=SECRET, streams=1, socket_buffer_bytes=1 << 18, stall_timeout_s=600)
    rx = TcpKVReceiver(dst, cfg=cfg)
    link = CuttableLink(rx.endpoint)
    tx = TcpKVSender(src, cfg)
    blocks = list(range(64))
    try:
        rx.expect("t1", blocks)
        h1 = tx.open(TransferTarget(link.endpoint, "t1", tuple(blocks), layout.compat_hash()))
        h1.send_layer(0, blocks, 0)
        assert wait_until(lambda: rx.bytes_received > 0, 10)
        link.cut()
        for layer in range(1, 8):  # 14 MiB more than the buffers hold: the writer blocks mid-frame
            h1.send_layer(layer, blocks, 0)
        stream = tx.channels_to(link.endpoint)[0].streams[0]
        assert wait_until(lambda: stream.sending == "t1", 10)
        time.sleep(0.5)
        assert stream.sending == "t1"  # stuck: the cut link takes no more
        h1.fail("re-placed: the link is down")  # what the prefill worker does when the router cancels it
        rx.cancel("t1")
        want = list(range(64, 128))
        rh2 = rx.expect("t2", want)
        h2 = tx.open(TransferTarget(link.endpoint, "t2", tuple(want), layout.compat_hash()))
        for layer in range(8):
            h2.send_layer(layer, blocks, 0)
        h2.finish(5, -0.25)
        assert h2.wait(60) is TransferState.DONE, h2.failure()
        assert rh2.wait(60) is TransferState.DONE, rh2.failure()
        assert torch.equal(dst.kv[:, :, want], src.kv[:, :, blocks])
        assert link.connections == 2  # the stuck one retired, a fresh one for t2
    finally:
        tx.close()
        rx.close()
        link.close()


def test_a_trickling_peer_is_cut_at_the_handshake_deadline():
    dst = make_cache(LAYOUT, 8, None)
    rx = TcpKVReceiver(dst, cfg=TransferConfig(secret=SECRET, connect_timeout_s=1.0))
    try:
        host, port = rx.endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            hello = pb.KVFrame(hello=pb.KVHello(protocol_version=PROTOCOL_VERSION, layout_hash=LAYOUT.compat_hash(),
                                                nonce=b"n" * 32)).SerializeToString()
            data = len(hello).to_bytes(4, "little") + hello
            t0 = time.monotonic()
            cut = False
            for b in data:  # one byte every 2 s: each read is quick, the handshake is not
                try:
                    s.sendall(bytes([b]))
                except OSError:
                    cut = True
                    break
                if _closed_by_peer(s, 2.0) or time.monotonic() - t0 > 30:
                    cut = True
                    break
            assert cut
            assert time.monotonic() - t0 < 30  # cut near the 1 s deadline, not after the whole hello
        assert wait_until(lambda: rx.refused == 1, 5)
    finally:
        rx.close()


def test_an_oversized_frame_is_refused_before_it_is_buffered():
    dst = make_cache(LAYOUT, 8, None)
    rx = TcpKVReceiver(dst, cfg=CFG)
    try:
        host, port = rx.endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall((512 << 20).to_bytes(4, "little") + b"x" * 1024)  # claims 512 MiB
            assert _closed_by_peer(s, 5.0)
        assert wait_until(lambda: rx.refused == 1, 5)
    finally:
        rx.close()


def test_a_flood_of_unauthenticated_connections_holds_no_threads_and_a_transfer_goes_through():
    src, dst = make_cache(LAYOUT, 8, 1), make_cache(LAYOUT, 8, None)
    rx = TcpKVReceiver(dst, cfg=TransferConfig(secret=SECRET, streams=1, connect_timeout_s=30.0))
    tx = TcpKVSender(src, TransferConfig(secret=SECRET, streams=1))
    host, port = rx.endpoint.rsplit(":", 1)
    flood: list[socket.socket] = []
    try:
        threads, rss = threading.active_count(), _rss_bytes()
        for i in range(1000):  # from 20 addresses (one address may hold 64): as many hosts would
            s = socket.create_connection((host, int(port)), source_address=(f"127.0.0.{2 + i % 20}", 0))
            s.sendall(b"\x10\x00" if i % 2 else b"")  # half send part of a length prefix, half nothing
            flood.append(s)
        assert wait_until(lambda: rx.gate.pending == 1000, 10)
        # a thread per connection would be +1,000; the margin is for threads other parts of this process start
        assert threading.active_count() - threads < 50
        assert _rss_bytes() - rss < 64 << 20  # a socket and a few bytes each, not a thread stack or a frame buffer
        rh = rx.expect("t", [2, 3])
        h = tx.open(TransferTarget(rx.endpoint, "t", (2, 3), LAYOUT.compat_hash()))
        h.send_layer(0, [0, 1], 0)
        h.send_layer(1, [0, 1], 0)
        h.finish(7, 0.0)
        assert h.wait(30) is TransferState.DONE and rh.wait(30) is TransferState.DONE, (h.failure(), rh.failure())
        assert torch.equal(dst.kv[:, :, [2, 3]], src.kv[:, :, [0, 1]])
    finally:
        for s in flood:
            s.close()
        tx.close()
        rx.close()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_pulled_blocks_that_do_not_match_their_mac_are_refused():
    """The shared-memory path: the sender's first transfer carries one altered
    MAC (fault injection); the receiver's check of the pulled blocks refuses it
    and names the blocks; the next transfer lands exactly."""
    shm = f"/dev/shm/kvrelay-test-mac-{os.getpid()}"
    src, dst = KVCache(LAYOUT, 8, shm_path=shm), make_cache(LAYOUT, 8, None)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(4)))
    rx = TcpKVReceiver(dst, cfg=CFG)
    tx = LocalKVSender(src, TransferConfig(secret=SECRET, streams=1, corrupt_first=1))
    try:
        for tid, ok in (("t", False), ("t2", True)):
            rh = rx.expect(tid, [2, 3])
            h = tx.open(TransferTarget(rx.endpoint, tid, (2, 3), LAYOUT.compat_hash()))
            for layer in range(LAYOUT.num_layers):
                h.send_layer(layer, [0, 1], 0)
            h.finish(1, 0.0)
            assert h.wait(20) is (TransferState.DONE if ok else TransferState.FAILED)
            if not ok:
                assert rh.wait(5) is TransferState.FAILED
                assert "pulled KV failed authentication" in rh.failure().reason and rh.failure().blocks == [2, 3]
            else:
                assert rh.wait(5) is TransferState.DONE
                assert torch.equal(dst.kv[:, :, [2, 3]], src.kv[:, :, [0, 1]])
            rx.cancel(tid)
    finally:
        tx.close()
        rx.close()
        src.unlink()


@pytest.mark.parametrize("drops", [1, 2])
def test_a_connection_that_dies_before_the_receiver_got_anything_is_replaced_once(drops):
    """A pooled connection dies just before it carries a transfer's first
    frame (the receiver's TCP acknowledged none of it): the transfer goes out
    again on a fresh connection and lands whole, once; a second such death
    fails it, and the receiver is left with nothing to wait for."""
    layout = KVLayout("m", "float32", 4, 2, 16, 4)
    src, dst = make_cache(layout, 16, 5), make_cache(layout, 32, None)
    cfg = TransferConfig(secret=SECRET, streams=1)
    rx = TcpKVReceiver(dst, cfg=cfg)
    link = CuttableLink(rx.endpoint)
    tx = TcpKVSender(src, cfg)
    blocks = list(range(8))
    try:
        rh1 = rx.expect("t1", blocks)  # the connection is pooled by a first transfer
        h1 = tx.open(TransferTarget(link.endpoint, "t1", tuple(blocks), layout.compat_hash()))
        for layer in range(4):
            h1.send_layer(layer, blocks, 0)
        h1.finish(3, -0.1)
        assert h1.wait(30) is TransferState.DONE and rh1.wait(30) is TransferState.DONE
        want = list(range(16, 24))
        rh2 = rx.expect("t2", want)
        h2 = tx.open(TransferTarget(link.endpoint, "t2", tuple(want), layout.compat_hash()))
        h2.drop_connections = drops
        for layer in range(4):
            h2.send_layer(layer, blocks, 0)
        h2.finish(5, -0.25)
        if drops == 1:
            assert h2.wait(30) is TransferState.DONE, h2.failure()
            assert rh2.wait(30) is TransferState.DONE, rh2.failure()
            assert rh2.result().first_token_id == 5
            assert torch.equal(dst.kv[:, :, want], src.kv[:, :, blocks])
            assert link.connections == 2  # the pooled one, then one fresh one for the resend
        else:
            assert h2.wait(30) is TransferState.FAILED
            assert f"connection to {link.endpoint}" in h2.failure().reason, h2.failure()
            # the link's accept thread counts the fresh connection when it gets to it (on a busy machine, after
            # the transfer already failed); nothing dials a third
            wait_until(lambda: link.connections >= 2, 10)
            assert link.connections == 2  # resent once only
            rx.cancel("t2")
            assert rh2.wait(5) is TransferState.FAILED
            assert not dst.kv[:, :, want].any()
    finally:
        tx.close()
        rx.close()
        link.close()
