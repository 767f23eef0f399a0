"""Links as shared pipes: KV transfers are flows that share a link's
bandwidth equally (processor sharing, a fluid model) and arrive one-way
latency (RTT / 2) after their last byte left.

A prefill worker adds a flow's bytes as its layers finish (layer-wise
streaming), so a flow is often idle, waiting for bytes: only flows with
bytes ready share the link. A link that goes down fails its flows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.benchmarks.sim.clock import Clock
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


class SimLink:
    def __init__(self, clock: Clock, view: LinkView) -> None:
        self.clock, self.view = clock, view
        self.bytes_per_s = view.gbps * 1e9 / 8
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
            self._finish(f, True, self.view.rtt_ms / 2e3)
        self._version += 1
        if self.active:
            least = min(f.ready for f in self.active)
            self.clock.after(least * len(self.active) / self.bytes_per_s, self._tick, self._version)

    def _tick(self, version: int) -> None:
        if version == self._version:
            self._advance()
            self._settle()

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
