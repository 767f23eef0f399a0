"""``kvrelay bench kv-gate``: a real sender's KV transfer time to a receiver,
quiet and then under the flood of finding 2 (issue 33) in the same run: one
address holding idle connections open against the gate while another
replays a captured hello as fast as the gate answers it. The receiver keeps
its real limits (64 pending per address, the hello's stamp, age and nonce
checked before any key exchange); the ratio of the medians is what the flood
costs a real sender."""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import torch

from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import TransferState, TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.handshake import SenderHello, client_handshake
from kvrelay.kvtransfer.protection import Protection
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from kvrelay.kvtransfer.wire import ProtocolError, frame_bytes, recv_frame
from kvrelay.v1 import kv_wire_pb2 as pb

SECRET = b"kv-gate-bench-secret-of-32-bytes!"
LAYOUT = KVLayout("gate", "float32", 30, 3, 64, 16)
"""SmolLM2-135M-Instruct's fp32 KV layout: 720 KiB per block over all layers."""
IDLE_SOURCE, REPLAY_SOURCE = "127.0.0.2", "127.0.0.3"


@dataclass(slots=True)
class GateBenchResult:
    blocks: int
    transfers: int
    idle_connections: int
    quiet_ms_p50: float
    quiet_ms_p90: float
    flood_ms_p50: float
    flood_ms_p90: float
    ratio_p50: float
    """Flood median over quiet median: what the flood costs a real sender."""
    replays_sent: int
    replays_refused: int
    gate_pending_during_flood: int

    def to_dict(self) -> dict:
        return asdict(self)


def captured_hello(want: SenderHello) -> bytes:
    """The hello a sender asking ``want`` sends, exactly as it crosses the wire (what an on-path
    observer can replay)."""
    ours, theirs = socket.socketpair()

    def handshake() -> None:
        try:
            client_handshake(ours, want)
        except (ProtocolError, OSError):
            pass  # we hang up after reading its hello
    t = threading.Thread(target=handshake, daemon=True)
    t.start()
    try:
        return frame_bytes(recv_frame(theirs)[1])
    finally:
        theirs.close()
        t.join(10)
        ours.close()


def _flood(addr: tuple[str, int], hello: bytes, idle: int, ready, stop, counts) -> None:
    """The attacker, in a process of its own: ``idle`` connections held open, then ``hello`` replayed
    until ``stop`` is set; ``counts``: replays sent and refused."""
    held = [socket.create_connection(addr, timeout=10, source_address=(IDLE_SOURCE, 0)) for _ in range(idle)]
    ready.set()
    while not stop.is_set():
        try:
            with socket.create_connection(addr, timeout=10, source_address=(REPLAY_SOURCE, 0)) as s:
                s.sendall(hello)
                counts[0] += 1
                answer = pb.KVHelloAnswer.FromString(recv_frame(s)[0].hello_ack.answer)
                counts[1] += not answer.accepted
        except (OSError, ProtocolError):
            continue
    for s in held:
        s.close()


class Flood:
    """:func:`_flood` in a process of its own (so it competes for the cores, not for this one's GIL)."""

    def __init__(self, endpoint: str, hello: bytes, idle: int) -> None:
        host, port = endpoint.rsplit(":", 1)
        ctx = multiprocessing.get_context("spawn")
        self.ready, self._stop, self.counts = ctx.Event(), ctx.Event(), ctx.Array("q", 2)
        self.proc = ctx.Process(target=_flood, args=((host, int(port)), hello, idle, self.ready, self._stop,
                                                     self.counts), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 60
        if not self.ready.wait(60) or not _until(lambda: self.sent > 0, deadline):  # under way, however busy
            self.stop()
            raise RuntimeError("the flood did not open its idle connections and replay a hello within 60 s")

    @property
    def sent(self) -> int:
        return int(self.counts[0])

    @property
    def refused(self) -> int:
        return int(self.counts[1])

    def stop(self) -> None:
        self._stop.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _until(pred, deadline: float) -> bool:
    """Polls ``pred`` until it holds (True) or ``deadline`` (time.monotonic) passes (False)."""
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _transfers(rx: TcpKVReceiver, tx: TcpKVSender, blocks: int, n: int, tag: str) -> list[float]:
    """Milliseconds of ``n`` transfers of ``blocks`` blocks, each from open to the receiver's DONE."""
    times = []
    ids = tuple(range(blocks))
    for i in range(n):
        rh = rx.expect(f"{tag}{i}", list(ids))
        t0 = time.perf_counter()
        h = tx.open(TransferTarget(rx.endpoint, f"{tag}{i}", ids, LAYOUT.compat_hash(), protection="aead"))
        for layer in range(LAYOUT.num_layers):
            h.send_layer(layer, list(ids), 0)
        h.finish(1, 0.0)
        if h.wait(60) is not TransferState.DONE or rh.wait(60) is not TransferState.DONE:
            raise RuntimeError(f"transfer {tag}{i} failed: {h.failure() or rh.failure()}")
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]


def run_gate_bench(blocks: int = 16, transfers: int = 20, idle: int = 200) -> GateBenchResult:
    """Quiet transfers, then the same while :class:`Flood` runs, on fresh connections each time."""
    cfg = TransferConfig(secret=SECRET, streams=1, protection=Protection.AEAD)
    src, dst = KVCache(LAYOUT, blocks), KVCache(LAYOUT, blocks)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(0)))
    rx = TcpKVReceiver(dst, cfg=cfg)
    try:
        tx = TcpKVSender(src, cfg)
        quiet = _transfers(rx, tx, blocks, transfers, "quiet")
        tx.close()
        flood = Flood(rx.endpoint, captured_hello(SenderHello(cfg.secret, LAYOUT.compat_hash(), None, cfg.protection)),
                      idle)
        try:
            time.sleep(0.5)  # the idle ones are in the gate, the replays under way
            pending = rx.gate.pending
            tx = TcpKVSender(src, cfg)  # its handshakes go through the gate during the flood
            loud = _transfers(rx, tx, blocks, transfers, "flood")
            tx.close()
        finally:
            flood.stop()
    finally:
        rx.close()
    q50, f50 = statistics.median(quiet), statistics.median(loud)
    return GateBenchResult(blocks, transfers, idle, round(q50, 2), round(_p90(quiet), 2), round(f50, 2),
                           round(_p90(loud), 2), round(f50 / q50, 3), flood.sent, flood.refused, pending)


def format_gate(r: GateBenchResult) -> str:
    mib = r.blocks * 2 * LAYOUT.num_layers * LAYOUT.block_bytes / (1 << 20)
    return (f"KV gate under a flood: {r.transfers} transfers of {mib:.1f} MiB each (aead, one stream)\n"
            f"  quiet:  p50 {r.quiet_ms_p50:.1f} ms, p90 {r.quiet_ms_p90:.1f} ms\n"
            f"  flood:  p50 {r.flood_ms_p50:.1f} ms, p90 {r.flood_ms_p90:.1f} ms  "
            f"(flood / quiet p50 = {r.ratio_p50:.2f})\n"
            f"  the flood: {r.idle_connections} idle connections from {IDLE_SOURCE} "
            f"({r.gate_pending_during_flood} held by the gate), {r.replays_sent} replayed hellos from "
            f"{REPLAY_SOURCE}, {r.replays_refused} refused")
