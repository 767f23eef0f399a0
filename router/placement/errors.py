"""Why a placement failed, and whether waiting at the router can help."""

from __future__ import annotations

import enum


class PlacementFailure(enum.StrEnum):
    """Why no placement is possible."""

    CONSTRAINT = "constraint"
    """The request's constraints exclude every worker (it is not served elsewhere)."""
    CAPACITY = "capacity"
    """Eligible workers exist but are full, or the estimated time to first token
    exceeds the deadline; retry after ``retry_after_s``."""
    UNAVAILABLE = "unavailable"
    """No healthy worker of a needed role."""


class Wait(enum.Enum):
    """What waiting at the router (holding nothing) can bring back."""

    NOTHING = enum.auto()
    """Waiting does not help: answer now."""
    ROOM = enum.auto()
    """Capacity is momentarily used up; running requests free it."""
    WORKERS = enum.auto()
    """Workers that could serve it may come back (restarting, or not yet
    registered with a router that just restarted)."""


class PlacementError(Exception):
    """No placement is possible: ``kind`` says why, ``wait`` whether waiting can help."""

    def __init__(self, kind: PlacementFailure, message: str, retry_after_s: float = 0.0,
                 wait: Wait = Wait.NOTHING) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s
        self.wait = wait

    @property
    def absent(self) -> bool:
        """Workers that could serve it may come back."""
        return self.wait is Wait.WORKERS

    @property
    def full(self) -> bool:
        """Capacity is momentarily used up."""
        return self.wait is Wait.ROOM
