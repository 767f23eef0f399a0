"""User-space delay line: one emulated long-distance link between two TUN
devices (``python -m kvrelay.launch.delayline``).

This kernel has no netem, so the one-way delay of a link between cities is
made here: every IP packet read from one TUN device is written to the other
``delay_ms`` later, in order, and the same in the other direction. The rate
is not made here but by a ``tbf`` qdisc on each TUN device, so packets reach
this process already paced and the queue of each direction never holds more
than a bandwidth-delay product (plus ``max_queue_bytes`` as a guard).

The process creates both TUN devices (in the namespace it starts in), prints
``READY`` once they exist, and forwards until SIGTERM. ``kvrelay cities``
then moves the devices into the two sites' namespaces; the open descriptors
stay attached. SIGUSR1 cuts the link (every packet is dropped, as when a
fibre is cut) and SIGUSR2 restores it: fault injection without touching
the namespaces."""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import fcntl
import logging
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_PR_SET_TIMERSLACK = 29

WAKE_ALPHA = 0.05
"""Weight of a new sample in the running mean of timed wake-up lateness."""

READ_BURST = 256
"""Packets read from one device per wake-up before the other gets a turn."""


def open_tun(name: str) -> int:
    """Creates TUN device ``name`` (raw IP packets, no packet-info header) and
    returns its non-blocking descriptor; the device lives while it is open."""
    if len(name.encode()) > 15:
        raise ValueError(f"TUN device name {name!r} is longer than 15 bytes")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass(slots=True)
class Direction:
    """Packets read from ``src`` waiting to be written to ``dst``."""

    src: int
    dst: int
    queue: collections.deque
    queued_bytes: int = 0
    forwarded: int = 0
    dropped: int = 0


class DelayLine:
    """Forwards packets between two TUN descriptors with a fixed one-way delay."""

    def __init__(self, fd_a: int, fd_b: int, delay_s: float, mtu: int, max_queue_bytes: int,
                 read_latency_s: float = 0.0) -> None:
        if delay_s < 0:
            raise ValueError("delay must not be negative")
        self.delay_s = max(0.0, delay_s - read_latency_s)
        self.wake_late_s = 0.0
        """Running mean of how late a timed wake-up comes; deadlines are moved forward by it."""
        self.mtu = mtu
        self.max_queue_bytes = max_queue_bytes
        self.dirs = {fd_a: Direction(fd_a, fd_b, collections.deque()),
                     fd_b: Direction(fd_b, fd_a, collections.deque())}
        self.cut = False
        self.running = True

    def _read(self, d: Direction) -> None:
        for _ in range(READ_BURST):
            try:
                pkt = os.read(d.src, self.mtu + 64)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN):
                    return
                raise
            if self.cut or d.queued_bytes + len(pkt) > self.max_queue_bytes:
                d.dropped += 1
                continue
            d.queue.append((time.monotonic() + self.delay_s, pkt))
            d.queued_bytes += len(pkt)

    def _flush(self, d: Direction, now: float) -> None:
        q = d.queue
        while q and q[0][0] <= now + self.wake_late_s:
            _, pkt = q.popleft()
            d.queued_bytes -= len(pkt)
            if self.cut:
                d.dropped += 1
                continue
            try:
                os.write(d.dst, pkt)
                d.forwarded += 1
            except OSError as exc:  # the receiving stack is full or the device went down: the packet is lost
                if exc.errno not in (errno.EAGAIN, errno.ENOBUFS, errno.EIO, errno.EINVAL, errno.EINTR):
                    raise
                d.dropped += 1

    def run(self) -> None:
        # select(), not epoll: its timeout has microsecond resolution (epoll's is
        # rounded up to whole milliseconds, which would add up to 1 ms per direction)
        fds = list(self.dirs)
        while self.running:
            now = time.monotonic()
            for d in self.dirs.values():
                self._flush(d, now)
            due = [d.queue[0][0] for d in self.dirs.values() if d.queue]
            wake_at = min(due) - self.wake_late_s if due else None
            timeout = max(0.0, wake_at - time.monotonic()) if wake_at is not None else 1.0
            try:
                ready, _, _ = select.select(fds, [], [], timeout)
            except InterruptedError:
                continue
            if not ready and wake_at is not None and timeout > 0:
                late = time.monotonic() - wake_at
                self.wake_late_s += WAKE_ALPHA * (min(max(late, 0.0), 0.002) - self.wake_late_s)
            for fd in ready:
                self._read(self.dirs[fd])

    def stats(self) -> str:
        a, b = self.dirs.values()
        return (f"forwarded {a.forwarded}/{b.forwarded} packets, dropped {a.dropped}/{b.dropped} "
                f"(a->b / b->a)")


NOBODY = 65534
_PR_SET_NO_NEW_PRIVS = 38


def drop_root() -> None:
    """Once the TUN devices are open (the one step that needs root), become
    ``nobody`` with no supplementary groups and no way back (no_new_privs):
    the open descriptors keep working, and root can still signal the process."""
    if os.geteuid() != 0:
        return
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        log.warning("could not set no_new_privs (errno %d)", ctypes.get_errno())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrelay.launch.delayline", description=__doc__.split("\n\n")[0])
    p.add_argument("--dev-a", required=True, help="name of the first TUN device to create")
    p.add_argument("--dev-b", required=True, help="name of the second TUN device to create")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay, each direction")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--read-latency-us", type=float, default=100.0,
                   help="time a packet waits in the TUN device before this process reads it; "
                        "taken off the delay so applications see the configured RTT")
    p.add_argument("--max-queue-bytes", type=int, default=256 << 20,
                   help="per direction; packets beyond it are dropped")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s delayline[{args.dev_a}<->{args.dev_b}] %(levelname)s %(message)s")
    try:  # the kernel may add up to 50 us to every timed wake-up by default; ask for 1 us
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except OSError:
        pass
    fd_a, fd_b = open_tun(args.dev_a), open_tun(args.dev_b)
    drop_root()
    line = DelayLine(fd_a, fd_b, args.delay_ms / 1000.0, args.mtu, args.max_queue_bytes,
                     args.read_latency_us / 1e6)

    def stop(*_):
        line.running = False

    def set_cut(value: bool):
        def handler(*_):
            line.cut = value
            log.warning("link %s", "cut: dropping every packet" if value else "restored")
        return handler

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, set_cut(True))
    signal.signal(signal.SIGUSR2, set_cut(False))
    print("READY", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # whoever read READY may be gone
    os.close(devnull)
    log.info("forwarding with %.3f ms one-way delay", args.delay_ms)
    line.run()
    log.info("stopped: %s", line.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
