"""The simulator's clock: a heap of timed callbacks, run in time order
(ties in the order they were scheduled, so a run is deterministic)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()
        self.events = 0
        """Callbacks run so far."""

    def at(self, t: float, fn: Callable, *args) -> None:
        """Runs ``fn(*args)`` at time ``t`` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = float("inf")) -> None:
        """Runs callbacks in order until none is left or the next is past ``until``."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
