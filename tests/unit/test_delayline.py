"""The user-space delay line, on packet sockets instead of TUN devices (no
root needed): every packet arrives whole, in order, no earlier than the
configured delay and not much later; a cut link drops everything; the queue
bound drops the excess instead of growing."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from launch.delayline import DelayLine


@pytest.fixture
def line():
    """(DelayLine, end a, end b): what is written to end a comes out of end b, and back."""
    a_out, a_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b_out, b_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a_in, b_in):
        s.setblocking(False)
    made: list[DelayLine] = []
    threads: list[threading.Thread] = []

    def make(delay_s: float, max_queue_bytes: int = 1 << 20) -> DelayLine:
        dl = DelayLine(a_in.fileno(), b_in.fileno(), delay_s, mtu=2048, max_queue_bytes=max_queue_bytes)
        t = threading.Thread(target=dl.run, daemon=True)
        t.start()
        made.append(dl)
        threads.append(t)
        return dl

    yield make, a_out, b_out
    for dl in made:
        dl.running = False
    for t in threads:
        t.join(2.0)
    for s in (a_out, a_in, b_out, b_in):
        s.close()


def _recv(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    sock.settimeout(timeout_s)
    data = sock.recv(4096)
    return data, time.monotonic()


def test_packets_arrive_in_order_after_the_delay(line):
    make, a, b = line
    make(0.03)
    sent = []
    for i in range(20):
        sent.append(time.monotonic())
        a.send(f"packet-{i}".encode() * 10)
        time.sleep(0.002)
    for i in range(20):
        data, at = _recv(b, 2.0)
        assert data == f"packet-{i}".encode() * 10
        assert 0.03 <= at - sent[i] < 0.03 + 0.1  # never early; late only by scheduling (a busy 2-core VM)


def test_both_directions(line):
    make, a, b = line
    make(0.01)
    a.send(b"east")
    b.send(b"west")
    assert _recv(b, 2.0)[0] == b"east"
    assert _recv(a, 2.0)[0] == b"west"


def test_a_cut_link_drops_everything_until_restored(line):
    make, a, b = line
    dl = make(0.005)
    dl.cut = True
    a.send(b"lost")
    with pytest.raises(TimeoutError):
        _recv(b, 0.2)
    dl.cut = False
    a.send(b"found")
    assert _recv(b, 2.0)[0] == b"found"
    assert next(iter(dl.dirs.values())).dropped == 1


def test_queue_bound_drops_the_excess(line):
    make, a, b = line
    dl = make(0.2, max_queue_bytes=10_000)
    for _ in range(10):
        a.send(b"x" * 2000)  # 20 kB into a 10 kB queue: the last five are dropped
    time.sleep(0.05)
    got = 0
    b.settimeout(1.0)
    try:
        while True:
            b.recv(4096)
            got += 1
            b.settimeout(0.3)
    except TimeoutError:
        pass
    first = next(iter(dl.dirs.values()))
    assert got == 5 and first.dropped == 5 and first.forwarded == 5


def test_negative_delay_is_refused():
    with pytest.raises(ValueError, match="negative"):
        DelayLine(0, 1, -1.0, 1500, 1 << 20)
