"""The user-space delay line, on packet sockets instead of TUN devices (no
root needed): every packet arrives whole, in order, no earlier than the
configured delay and not much later; a cut link drops everything; the queue
bound drops the excess instead of growing."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvrelay.launch.delayline import DelayLine

pytestmark = pytest.mark.serial  # timing of an emulated link: measured alone


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


EARLY_S = 0.0025
"""How early the delay line may forward a packet: it wakes ahead of a deadline
by its running mean of wake-up lateness, capped at 2 ms (launch/delayline.py)."""


def test_packets_arrive_in_order_after_the_delay(line):
    """Received while sending (the arrival times are the packets' own): every
    packet whole, in order, never early; on a busy machine a packet may come
    late by scheduling, so the bound on lateness is a gross one for all of them
    and a tight one for the best of them (a line that adds delay of its own fails it)."""
    make, a, b = line
    delay = 0.05
    make(delay)
    got: list[tuple[bytes, float]] = []
    rx = threading.Thread(target=lambda: got.extend(_recv(b, 5.0) for _ in range(20)), daemon=True)
    rx.start()
    sent = []
    for i in range(20):
        sent.append(time.monotonic())
        a.send(f"packet-{i}".encode() * 10)
        time.sleep(0.002)
    rx.join(30)
    assert [data for data, _ in got] == [f"packet-{i}".encode() * 10 for i in range(20)]
    late = [at - t - delay for (_, at), t in zip(got, sent, strict=True)]
    assert min(late) >= -EARLY_S, late  # never early (but for the wake-up allowance)
    assert max(late) < 1.0, late  # late only by scheduling (a busy 2-core VM)
    assert min(late) < delay / 2, late  # and the line itself adds nothing like a delay of its own


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
    b.settimeout(1.5)  # all five are due 0.2 s after they were sent; a busy machine may add some
    try:
        while True:
            b.recv(4096)
            got += 1
    except TimeoutError:
        pass
    first = next(iter(dl.dirs.values()))
    assert got == 5 and first.dropped == 5 and first.forwarded == 5


def test_negative_delay_is_refused():
    with pytest.raises(ValueError, match="negative"):
        DelayLine(0, 1, -1.0, 1500, 1 << 20)
