"""Measures an emulated link between two site namespaces: RTT (TCP echo of
one byte, median of many) and bulk TCP throughput (one stream, rate at the
receiver after slow start). Both ends run in this process: a socket belongs
to the network namespace its creating thread was in, so each socket is made
inside its site's namespace (setns) and used from here."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


@contextlib.contextmanager
def in_netns(netns: str):
    """Runs the body with this thread inside ``netns`` (by name, as `ip netns` made it)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(target, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
        try:
            yield
        finally:
            if _libc.setns(own, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back: {os.strerror(err)}")
    finally:
        os.close(own)
        os.close(target)


@dataclass(slots=True)
class LinkMeasurement:
    rtt_ms: float
    """Median TCP round trip of one byte each way."""
    rtt_min_ms: float
    gbps: float
    """Bulk throughput of one TCP stream after the warm-up, at the receiver."""
    seconds: float


def _connect(netns: str, host: str, port: int, timeout_s: float) -> socket.socket:
    with in_netns(netns):
        s = socket.create_connection((host, port), timeout=timeout_s)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


@contextlib.contextmanager
def _peer(src_ns: str, dst_ns: str, dst_host: str, timeout_s: float, serve, join_s: float):
    """A TCP connection from ``src_ns`` to a listener in ``dst_ns`` whose one
    accepted connection ``serve(conn)`` handles in a thread; yields the client
    socket, then waits for ``serve`` and re-raises what it raised."""
    with in_netns(dst_ns):
        srv = socket.create_server((dst_host, 0))
    srv.settimeout(timeout_s)
    err: list[BaseException] = []

    def run():
        try:
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(timeout_s)
            with conn:
                serve(conn)
        except OSError as exc:
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        with _connect(src_ns, dst_host, srv.getsockname()[1], timeout_s) as c:
            yield c
            c.shutdown(socket.SHUT_WR)
            t.join(join_s)
    finally:
        srv.close()
    if err:
        raise err[0]


def measure_rtt(src_ns: str, dst_ns: str, dst_host: str, samples: int = 30, timeout_s: float = 5.0) -> list[float]:
    """Round-trip times (seconds) of one-byte pings over one TCP connection."""
    def echo(conn: socket.socket) -> None:
        while b := conn.recv(1):
            conn.sendall(b)

    rtts: list[float] = []
    with _peer(src_ns, dst_ns, dst_host, timeout_s, echo, timeout_s) as c:
        for _ in range(samples + 2):
            t0 = time.perf_counter()
            c.sendall(b"x")
            if c.recv(1) != b"x":
                raise ConnectionError("echo peer closed")
            rtts.append(time.perf_counter() - t0)
            time.sleep(0.01)
    return rtts[2:]  # the first exchanges include ARP/route setup


def measure_throughput(src_ns: str, dst_ns: str, dst_host: str, seconds: float = 4.0, warmup_s: float = 1.0,
                       timeout_s: float = 10.0) -> float:
    """Bytes per second one TCP stream delivers from ``src_ns`` to ``dst_host``,
    measured at the receiver from ``warmup_s`` after the first byte to the last."""
    result: list[float] = []

    def sink(conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        first = None
        counted, t_start, t_last = 0, 0.0, 0.0
        while n := conn.recv_into(buf):
            now = time.perf_counter()
            if first is None:
                first = now
            if now - first >= warmup_s:
                if not t_start:
                    t_start = now
                else:
                    counted += n
                t_last = now
        result.append(counted / (t_last - t_start) if t_last > t_start else 0.0)

    with _peer(src_ns, dst_ns, dst_host, timeout_s, sink, timeout_s + seconds) as c:
        chunk = memoryview(bytearray(1 << 20))
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            c.sendall(chunk)
    if not result:
        raise TimeoutError("the receiver did not finish in time")
    return result[0]


def measure_link(src_ns: str, dst_ns: str, dst_host: str, seconds: float = 4.0) -> LinkMeasurement:
    rtts = measure_rtt(src_ns, dst_ns, dst_host)
    rate = measure_throughput(src_ns, dst_ns, dst_host, seconds)
    return LinkMeasurement(statistics.median(rtts) * 1e3, min(rtts) * 1e3, rate * 8 / 1e9, seconds)
