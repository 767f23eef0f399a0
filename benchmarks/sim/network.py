"""Links as shared pipes: KV transfers are flows that share a link's
bandwidth equally (processor sharing, a fluid model) and arrive one-way
latency (RTT / 2) after their last byte left.

A prefill worker adds a flow's bytes as its layers finish (layer-wise
streaming), so a flow is often idle, waiting for bytes: only flows with
bytes ready share the link. A link that goes down fails its flows; its
rate may change while flows cross it (``set_rate``).

Each flow that lands is timed as a live sender times its transfer
(kvtransfer/channel.py): first byte to last, whether the link set its pace
(it had bytes waiting for 90% of that time), and its bytes' rate over the
time the link held them (link-bound) or over all of it (a lower bound);
the samples go to ``on_sample`` (the router's link estimate,
router/placement/link_estimate.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.benchmarks.sim.clock import Clock
from kvrelay.router.placement.link_estimate import Crossing, LinkSample
from kvrelay.router.placement.place import LinkView

DRAINED_S = 1e-9
"""A flow with less than this many seconds of the link's rate left is drained
(so the clock always moves: far below this, now + delay == now in floating point)."""


@dataclass(slots=True, eq=False)
class Flow:
    """One request's KV on its way from a prefill worker to a decode worker."""

    link: SimLink
    on_done: Callable[[bool], None]
    """Called with True when the last byte arrived, False when the link failed it."""
    ready: float = 0.0
    """Bytes produced and not yet sent."""
    closed: bool = False
    """Every byte has been produced."""
    sent: float = 0.0
    over: bool = False
    first_s: float | None = None
    """When its first byte was ready to leave."""
    waiting_s: float = 0.0
    """Time it had bytes ready (the link, not the producer, held them)."""
    crossing: Crossing | None = None
    """Its count on the router's link estimate (LinkMeter.begin), set by whoever opened it."""


BOUND_SHARE, BOUND_MIN_S = 0.9, 0.1
"""A flow is link-bound when it had bytes waiting for this share of its time, at least this long
(kvtransfer/channel.py's LINK_BOUND_SHARE and LINK_BOUND_MIN_S)."""


class SimLink:
    def __init__(self, clock: Clock, view: LinkView, on_sample: Callable[[Flow, LinkSample], None] | None = None
                 ) -> None:
        """``view``: what placement reads (its configured figures are the link's physical ones at the start;
        a measured estimate may change the view's, never the link's)."""
        self.clock, self.view, self.on_sample = clock, view, on_sample
        self.bytes_per_s = view.gbps * 1e9 / 8
        self.rtt_ms = view.rtt_ms
        self.eps = self.bytes_per_s * DRAINED_S
        self.active: list[Flow] = []
        self.flows: dict[Flow, None] = {}
        """Open flows, in the order they opened (an ordered set: runs are deterministic)."""
        self._last = 0.0
        self._version = 0
        self.bytes_sent = 0.0
        self.busy_s = 0.0
        """Time with at least one flow sending."""

    @property
    def name(self) -> str:
        return self.view.name

    def open(self, on_done: Callable[[bool], None]) -> Flow:
        flow = Flow(self, on_done)
        self.flows[flow] = None
        return flow

    def _advance(self) -> None:
        now = self.clock.now
        if self.active and now > self._last:
            share = (now - self._last) * self.bytes_per_s / len(self.active)
            for f in self.active:
                n = min(share, f.ready)
                f.ready -= n
                f.sent += n
                f.waiting_s += now - self._last
                self.bytes_sent += n
            self.busy_s += now - self._last
        self._last = now

    def add(self, flow: Flow, nbytes: float) -> None:
        """``nbytes`` more of ``flow`` are ready to send."""
        if flow.over:
            return
        self._advance()
        flow.ready += nbytes
        if flow not in self.active and flow.ready > self.eps:
            self.active.append(flow)
            if flow.first_s is None:
                flow.first_s = self.clock.now
        self._settle()

    def close(self, flow: Flow) -> None:
        """Every byte of ``flow`` has been produced."""
        if flow.over:
            return
        self._advance()
        flow.closed = True
        self._settle()

    def _settle(self) -> None:
        """Retires drained flows, then schedules the next one to drain."""
        for f in [f for f in self.active if f.ready <= self.eps]:
            self.active.remove(f)
        for f in [f for f in self.flows if f.closed and f not in self.active]:
            self._timed(f)
            self._finish(f, True, self.rtt_ms / 2e3)
        self._version += 1
        if self.active:
            least = min(f.ready for f in self.active)
            self.clock.after(least * len(self.active) / self.bytes_per_s, self._tick, self._version)

    def _tick(self, version: int) -> None:
        if version == self._version:
            self._advance()
            self._settle()

    def set_rate(self, gbps: float) -> None:
        """The link's rate changes now (flows crossing it go on at the new rate)."""
        self._advance()
        self.bytes_per_s = gbps * 1e9 / 8
        self.eps = self.bytes_per_s * DRAINED_S
        self._settle()

    def _timed(self, flow: Flow) -> None:
        """``flow``'s last byte left: its sample, as its sender would report it once acknowledged."""
        if self.on_sample is None or flow.first_s is None:
            return
        busy = self.clock.now - flow.first_s
        if busy <= 0:
            return
        bound = busy >= BOUND_MIN_S and flow.waiting_s >= BOUND_SHARE * busy
        carried = min(flow.waiting_s, busy) if bound else busy  # link-bound: bytes over the time the link held them
        self.on_sample(flow, LinkSample(self.clock.now + self.rtt_ms / 1e3, flow.sent * 8 / carried / 1e9, bound,
                                        self.rtt_ms))

    def _finish(self, flow: Flow, ok: bool, delay: float) -> None:
        flow.over = True
        self.flows.pop(flow, None)
        if flow in self.active:
            self.active.remove(flow)
        self.clock.after(delay, flow.on_done, ok)

    def fail_all(self) -> None:
        """The link went down: every flow on it fails now."""
        self._advance()
        for f in list(self.flows):
            self._finish(f, False, 0.0)
        self._version += 1

    def cancel(self, flow: Flow) -> None:
        """Drops ``flow`` silently (its request ended elsewhere)."""
        if not flow.over:
            self._advance()
            flow.over = True
            self.flows.pop(flow, None)
            if flow in self.active:
                self.active.remove(flow)
            self._settle()
