"""Who goes next when requests wait at the router for room: weighted fair
queueing across tenants.

A request that finds room is placed at once. One that does not (every
eligible worker full), or that arrives while others wait, takes a ticket
and waits, holding nothing. Tickets are served in the order of

    (tenant's priority class, interactive before batch, virtual finish time)

where a tenant's virtual finish time grows by ``cost / weight`` per request
(start-time fair queueing: ``start = max(virtual time, tenant's last
finish)``; cost = prompt + max_tokens). So under contention each class is
served before the next, interactive requests before batch ones, and within
that tenants share capacity in proportion to their weights: a tenant
flooding the queue delays only itself.

Whenever capacity may have freed up (a request ended, a heartbeat, a new
ticket, or every ``PUMP_S``) the queue tries its tickets in order; a ticket
whose placement fails for lack of room stays, and the next is tried (it may
need other workers), skipping tickets with the same constraints as one
that just failed (whatever their tenant: so a large request is not
overtaken forever by small ones that fit the same workers). A placement
made for a ticket holds its capacity at once, so no two tickets get the
same room. A tenant with nothing waiting starts at the queue's virtual
time: requests of its that gave up waiting leave it no debt.

Shedding early: the queue measures how fast it serves tickets while it has
some (over the last SHED_WINDOW_S of backlog). A request that would wait
behind ``ahead`` tickets is told at once, with a retry hint, when at that
rate its turn would come after it may wait (its deadline, or
``admission_wait_s``), instead of waiting toward its deadline and failing
late (:meth:`FairQueue.expected_wait`). With no measure yet (less than
SHED_MIN_BACKLOG_S of backlog, or fewer than SHED_MIN_SERVED served in a
backlog shorter than SHED_WINDOW_S: requests may just be long) nobody is
shed."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.router.placement.errors import PlacementError, Wait

log = logging.getLogger(__name__)

PUMP_S = 0.1
"""Longest time between two tries of the waiting tickets (room also frees up without an event: heartbeats)."""
PUMP_TRIES = 8
"""Most placements a pass over the waiting tickets tries in one turn of the
event loop (a decision takes ~0.1-1 ms: a turn holds the loop a few ms at
most); then it lets the loop run and carries on where it stopped."""
SHED_WINDOW_S = 10.0
"""The queue's service rate is measured over the last this many seconds of backlog."""
SHED_MIN_BACKLOG_S = 2.0
"""Nobody is shed before the queue has had tickets this long (its rate is not known yet)."""
SHED_MIN_SERVED = 2
"""... nor before it has served this many, unless it has served fewer in a whole SHED_WINDOW_S."""


@dataclass(slots=True)
class Ticket:
    """One waiting request."""

    tag: tuple
    """(class rank, batch?, virtual finish time, arrival number): smaller goes first."""
    tenant: str
    start: float
    """Its virtual start time."""
    constraints: Hashable
    """Tickets with equal constraints fit the same workers (one failing to fit skips the others)."""
    try_place: Callable[[], Any]
    """Places it and holds the capacity, or raises PlacementError."""
    future: asyncio.Future
    interactive: bool
    last_error: PlacementError | None = None
    queued: bool = True
    """Still waiting (False once withdrawn)."""


@dataclass(slots=True)
class FairQueue:
    """The tickets waiting for room, and each tenant's virtual finish time."""

    vtime: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    waiting: list[Ticket] = field(default_factory=list)
    _arrivals: itertools.count = field(default_factory=itertools.count)
    _timer: asyncio.TimerHandle | None = None
    _rest: asyncio.Handle | None = None
    """The rest of a pass cut short, or a new pass asked for meanwhile (one at a time)."""
    _again: bool = False
    _served: deque = field(default_factory=deque)
    """Loop times at which tickets were served, the last SHED_WINDOW_S of them."""
    _backlog_since: float | None = None
    """Since when tickets have waited without a break (None: none wait)."""

    @property
    def interactive_waiting(self) -> int:
        return sum(t.interactive for t in self.waiting)

    def ticket(self, tenant: str, rank: int, interactive: bool, weight: float, cost: float,
               constraints: Hashable, try_place: Callable[[], Any]) -> Ticket:
        """Queues a request; its future gets the placement (or the PlacementError that ends its wait)."""
        # a tenant with nothing waiting starts at the virtual time: requests of its
        # that gave up waiting (deadline, caller gone) leave it no debt
        backlogged = any(t.tenant == tenant for t in self.waiting)
        start = max(self.vtime, self.finish.get(tenant, 0.0)) if backlogged else self.vtime
        self.finish[tenant] = start + max(cost, 1.0) / weight
        t = Ticket((rank, not interactive, self.finish[tenant], next(self._arrivals)), tenant, start, constraints,
                   try_place, asyncio.get_running_loop().create_future(), interactive)
        self.waiting.append(t)
        self.waiting.sort(key=lambda x: x.tag)
        self._noted(asyncio.get_running_loop().time(), False)
        self.pump()
        return t

    def ahead_of(self, rank: int, interactive: bool) -> int:
        """Tickets a new one of this class would wait behind (its class or a better one)."""
        return sum(1 for t in self.waiting if t.tag[:2] <= (rank, not interactive))

    def expected_wait(self, ahead: int, now: float) -> tuple[float, float] | None:
        """(seconds until a ticket behind ``ahead`` others would be served, tickets served per second) at
        the rate measured over the backlog's last SHED_WINDOW_S; None while that is not known."""
        if self._backlog_since is None or now - self._backlog_since < SHED_MIN_BACKLOG_S:
            return None
        span = min(SHED_WINDOW_S, now - self._backlog_since)
        served = sum(1 for at in self._served if at >= now - span)
        if served < SHED_MIN_SERVED and span < SHED_WINDOW_S:
            return None  # too few to measure by yet (requests may simply be long)
        rate = served / span
        return ((ahead + 1) / rate if rate > 0 else float("inf")), rate

    def _noted(self, now: float, served: bool) -> None:
        """Keeps the service measure: a ticket served now (``served``), and whether tickets still wait."""
        if served:
            self._served.append(now)
        while self._served and self._served[0] < now - SHED_WINDOW_S:
            self._served.popleft()
        if not self.waiting:
            self._backlog_since = None
        elif self._backlog_since is None:
            self._backlog_since = now

    def served_elsewhere(self, tenant: str, cost: float, weight: float) -> None:
        """Service another router gave ``tenant`` (``cost``: prompt + max_tokens, as a ticket's): its tickets
        waiting here move back by ``cost / weight``, so its weight holds across routers; a tenant with
        nothing waiting here is not charged (no debt, as for requests that gave up waiting)."""
        mine = [t for t in self.waiting if t.tenant == tenant]
        if not mine or cost <= 0:
            return
        shift = cost / weight
        for t in mine:
            t.tag, t.start = (t.tag[0], t.tag[1], t.tag[2] + shift, t.tag[3]), t.start + shift
        self.finish[tenant] = self.finish.get(tenant, self.vtime) + shift
        self.waiting.sort(key=lambda x: x.tag)

    def withdraw(self, t: Ticket) -> None:
        """The request stopped waiting (its deadline or admission wait passed, or its caller left)."""
        t.queued = False
        if t in self.waiting:
            self.waiting.remove(t)
        self._noted(asyncio.get_running_loop().time(), False)

    def pump(self) -> None:
        """Tries the waiting tickets in order; each one placed leaves the queue
        with its placement. A long pass is cut into turns of PUMP_TRIES tries (one
        pass at a time: a pump asked for meanwhile starts a new pass after it)."""
        if self._rest is not None:
            self._again = True
            return
        self._sweep(list(self.waiting), set())

    def _sweep(self, todo: list[Ticket], full: set) -> None:
        self._rest = None
        tries = 0
        for k, t in enumerate(todo):
            if tries == PUMP_TRIES:
                self._rest = asyncio.get_running_loop().call_soon(self._sweep, todo[k:], full)
                return
            if t.future.done():
                if t in self.waiting:
                    self.waiting.remove(t)
                continue
            if t.constraints in full or not t.queued:
                continue
            tries += 1
            try:
                placed = t.try_place()
            except PlacementError as exc:
                t.last_error = exc
                if exc.wait is Wait.NOTHING:  # waiting cannot help it: answer now
                    self.waiting.remove(t)
                    t.future.set_exception(exc)
                else:
                    full.add(t.constraints)
                continue
            except Exception as exc:  # a bug placing one request fails that request, not the queue
                log.exception("placing a waiting request failed")
                self.waiting.remove(t)
                t.future.set_exception(exc)
                continue
            self.waiting.remove(t)
            self.vtime = max(self.vtime, t.start)
            t.future.set_result(placed)
            self._noted(asyncio.get_running_loop().time(), True)
        self._noted(asyncio.get_running_loop().time(), False)
        if self._again:
            self._again = False
            self._rest = asyncio.get_running_loop().call_soon(self._pump_anew)
        self._schedule()

    def _pump_anew(self) -> None:
        self._rest = None
        self.pump()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.waiting:
            self._timer = asyncio.get_running_loop().call_later(PUMP_S, self.pump)
