"""The router's disk: free space where its records live, and the reserves
that keep room for the audit log.

The jobs database, the audit log and the usage database may share a volume
(in the Helm chart they do). Batch jobs are what can fill it fastest, so they
stop first: below ``router.records.min_free_bytes_for_jobs`` free on any of
those filesystems, new jobs are refused (RESOURCE_EXHAUSTED); below
``router.records.min_free_bytes``, every new request is (UNAVAILABLE),
since each writes an audit record and one that cannot be written is lost.
Deleting jobs (DeleteJob, the retention sweeper) gives the room back.

The state shows in ``kvrelay status`` (Registry.ListWorkers' ``storage``)
and in metrics: ``kvrelay_router_store_free_bytes{store}`` and
``kvrelay_router_refusing{work}`` (1 while that work is refused for lack of
disk)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.runtime.config import RecordsSection

MEASURE_EVERY_S = 1.0
"""How long one measurement of free space is reused (a request does not pay a statvfs)."""


class Work(StrEnum):
    """What a lack of disk refuses, jobs first."""

    JOBS = "jobs"
    REQUESTS = "requests"


@dataclass(frozen=True, slots=True)
class StoreSpace:
    """Free space on the filesystem of one store (its folder)."""

    store: str
    """jobs_db, audit_log or usage_db."""
    folder: str
    free_bytes: int


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class DiskReserve:
    """Free space of the stores' filesystems against the configured reserves."""

    def __init__(self, stores: Mapping[str, str | None], records: RecordsSection,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``stores``: name -> file (None or ":memory:": not on disk, not watched)."""
        self.folders = {name: str(Path(path).resolve().parent) for name, path in stores.items()
                        if path and path != ":memory:"}
        self.reserve = {Work.JOBS: records.min_free_bytes_for_jobs, Work.REQUESTS: records.min_free_bytes}
        self.clock = clock
        self._lock = threading.Lock()
        self._measured: tuple[float, list[StoreSpace]] | None = None

    def spaces(self) -> list[StoreSpace]:
        """Free space of every watched store (measured at most every MEASURE_EVERY_S)."""
        now = self.clock()
        with self._lock:
            if self._measured is not None and now - self._measured[0] < MEASURE_EVERY_S:
                return self._measured[1]
            got = [StoreSpace(name, folder, _free(folder)) for name, folder in self.folders.items()]
            self._measured = (now, got)
            return got

    def short(self, work: Work) -> StoreSpace | None:
        """The store whose filesystem is under ``work``'s reserve (None: every one has room)."""
        low = [s for s in self.spaces() if s.free_bytes < self.reserve[work]]
        return min(low, key=lambda s: s.free_bytes) if low else None

    def refusal(self, work: Work) -> RouterError | None:
        """Why new ``work`` is refused for lack of disk (None: it is not)."""
        s = self.short(work)
        if s is None:
            return None
        kind = ErrorKind.OVERLOADED if work is Work.JOBS else ErrorKind.UNAVAILABLE
        field = "min_free_bytes_for_jobs" if work is Work.JOBS else "min_free_bytes"
        return RouterError(kind, f"the router's disk is nearly full ({_mib(s.free_bytes)} free where its {s.store} "
                                 f"is, under router.records.{field} = {_mib(self.reserve[work])}): new {work.value} "
                                 "are refused so that audit records can still be written; retry later",
                           retry_after_s=60.0)

    def describe(self) -> str:
        """One line for ``kvrelay status``."""
        if not self.folders:
            return "records: in memory only"
        spaces = self.spaces()
        free = ", ".join(f"{s.store} {_mib(s.free_bytes)}" for s in spaces)
        refusing = [w.value for w in Work if self.short(w) is not None]
        state = f"REFUSING new {' and '.join(refusing)}" if refusing else "accepting"
        return (f"disk free: {free} (jobs stop under {_mib(self.reserve[Work.JOBS])}, requests under "
                f"{_mib(self.reserve[Work.REQUESTS])}): {state}")


def _free(folder: str) -> int:
    """Bytes an unprivileged writer may still use on ``folder``'s filesystem (0: the folder is gone)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class DiskCollector(Collector):
    """``kvrelay_router_store_free_bytes{store}`` and ``kvrelay_router_refusing{work}``, read at each scrape."""

    def __init__(self, disk: DiskReserve) -> None:
        self.disk = disk

    def collect(self) -> Iterator[GaugeMetricFamily]:
        free = GaugeMetricFamily("kvrelay_router_store_free_bytes",
                                 "free bytes on the filesystem of the router's store", labels=["store"])
        for s in self.disk.spaces():
            free.add_metric([s.store], float(s.free_bytes))
        yield free
        refusing = GaugeMetricFamily("kvrelay_router_refusing",
                                     "1 while the router refuses new work of this kind for lack of disk",
                                     labels=["work"])
        for w in Work:
            refusing.add_metric([w.value], 1.0 if self.disk.short(w) is not None else 0.0)
        yield refusing
