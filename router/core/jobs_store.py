"""Durable storage of batch jobs: an embedded SQLite database at the router.

Each request of a job is a row that moves pending -> running -> done or
failed (or cancelled). A result is written in the same transaction that
moves its row out of running, and only from running, so a result is stored
exactly once. On start, rows left running by a router that died go back to
pending: unfinished jobs resume, finished requests are never redone.

The database holds prompts and outputs: it is made 0600 (its -wal and -shm
files too) in a folder made 0700, and deleted rows are overwritten
(``secure_delete``). Jobs are deleted by their owner (DeleteJob) or, once
finished, by the retention sweeper (router/governance/retention.py).

Each job carries ``bytes``, what it holds on disk (its requests, then also
its results as they are stored): with the count of jobs, what a tenant's
``max_stored_jobs`` and ``max_stored_job_bytes`` bound (:meth:`JobStore.submit`
refuses a job past either, in the transaction that would store it). New
databases vacuum as they go (``auto_vacuum``), so a deleted job's pages go
back to the filesystem.

Synchronous by design: the router calls it through one worker thread
(router/frontends/jobs.py), so the event loop never waits on the disk. Each method
holds the store's lock, so another thread (the retention sweeper's) may
share the store: calls are serialized, never interleaved in one connection."""

from __future__ import annotations

import builtins
import functools
import itertools
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvrelay.runtime.files import create_private, private_sqlite_sides

PENDING, RUNNING, DONE, FAILED, CANCELLED = range(5)
JOB_QUEUED, JOB_RUNNING, JOB_DONE, JOB_CANCELLED = 1, 2, 3, 4  # = kvrelay.v1.JobState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, state INTEGER NOT NULL,
    total INTEGER NOT NULL, created REAL NOT NULL, finished REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS items (
    job TEXT NOT NULL, idx INTEGER NOT NULL, request BLOB NOT NULL,
    status INTEGER NOT NULL, result BLOB, PRIMARY KEY (job, idx));
CREATE INDEX IF NOT EXISTS items_by_status ON items (status, job, idx);
"""
_OWNER = "ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''"
"""The tenant that submitted a job (databases made before tenants get it empty)."""
_SEQ = "ALTER TABLE items ADD COLUMN seq INTEGER"
"""Order in which a job's results were stored (1, 2, ...; NULL while there is none)."""
_SEQ_BACKFILL = "UPDATE items SET seq = idx + 1 WHERE seq IS NULL AND status IN (?, ?)"
"""Results stored before ``seq`` existed: in index order, before every later one."""
_SEQ_INDEX = "CREATE INDEX IF NOT EXISTS items_by_seq ON items (job, seq)"
_BYTES = "ALTER TABLE jobs ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0"
"""What the job holds on disk: its requests and the results stored so far."""
_BYTES_BACKFILL = ("UPDATE jobs SET bytes = (SELECT COALESCE(SUM(LENGTH(request) + COALESCE(LENGTH(result), 0)), 0) "
                   "FROM items WHERE items.job = jobs.id)")
RESULT_PAGE = 1000
"""Most results one read returns (a reader pages through the rest)."""


@dataclass(slots=True)
class JobRow:
    id: str
    name: str
    state: int
    total: int
    completed: int
    failed: int
    created: float
    finished: float
    owner: str = ""
    """Tenant that submitted it ("" without client authentication)."""
    bytes: int = 0
    """What it holds on disk: its requests and the results stored so far."""


@dataclass(frozen=True, slots=True)
class StoredLimits:
    """What one tenant may hold in the store (its ``max_stored_jobs`` and ``max_stored_job_bytes``)."""

    jobs: int
    bytes: int


class StoreLimitExceeded(Exception):
    """A submission past its tenant's :class:`StoredLimits`; the message names the limit."""


class JobStoreUnavailable(Exception):
    """The jobs database cannot be reached now (the shared one: router/core/shared_jobs.py); the message names it."""


def over_limits_message(owner: str, n: int, held: int, size: int, limits: StoredLimits) -> str | None:
    """Why ``owner``, storing ``n`` jobs of ``held`` bytes, may not store one more of ``size`` (None: it may)."""
    if n + 1 > limits.jobs:
        return (f"tenant {owner!r} stores {n} jobs, its max_stored_jobs quota; "
                "delete finished ones (kvrelay job delete) to submit more")
    if held + size > limits.bytes:
        return (f"tenant {owner!r} stores {held} bytes of jobs and this one is {size}: over its "
                f"max_stored_job_bytes quota ({limits.bytes}); delete finished ones (kvrelay job delete) first")
    return None


class JobStorage(Protocol):
    """What the Jobs service and the retention sweeper use: :class:`JobStore` (one router's
    SQLite) or the routers' shared one (router/core/shared_jobs.py)."""

    def close(self) -> None: ...
    def resume(self) -> int: ...
    def reclaim(self, live: Iterable[str], grace_s: float) -> int: ...
    def over_limits(self, owner: str, size: int, limits: StoredLimits) -> str | None: ...
    def submit(self, name: str, requests: list[bytes], owner: str = "",
               limits: StoredLimits | None = None) -> JobRow: ...
    def get(self, job: str) -> JobRow | None: ...
    def list(self, owner: str | None = None) -> builtins.list[JobRow]: ...
    def cancel(self, job: str) -> JobRow | None: ...
    def claim(self, n: int, skip_owners: frozenset[str] = frozenset()) -> builtins.list[tuple[str, int, bytes, str]]:
        ...
    def finish(self, job: str, idx: int, result: bytes, ok: bool) -> bool: ...
    def release(self, job: str, idx: int) -> None: ...
    def state(self, job: str) -> int | None: ...
    def last_seq(self, job: str) -> int: ...
    def results(self, job: str, from_idx: int = 0, after_idx: int = -1, upto_seq: int | None = None,
                limit: int = RESULT_PAGE) -> builtins.list[tuple[int, int, bytes]]: ...
    def results_after(self, job: str, after_seq: int,
                      limit: int = RESULT_PAGE) -> builtins.list[tuple[int, int, bytes]]: ...
    def finished_before(self, before_ts: float) -> builtins.list[JobRow]: ...
    def delete(self, job: str) -> int | None: ...


def _serialized(method):
    """``method`` under the store's lock (one connection, one caller at a time)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class JobStore:
    def __init__(self, path: str | Path) -> None:
        """Opens (creating if needed) the database at ``path`` (":memory:" = not durable)."""
        self._lock = threading.RLock()
        durable = str(path) != ":memory:"
        if durable:
            create_private(Path(path))
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA secure_delete=ON")  # a deleted prompt does not stay in a free page
        self.db.execute("PRAGMA auto_vacuum=FULL")  # takes effect on a new database: freed pages leave the file
        if durable:
            private_sqlite_sides(Path(path))
        self.db.executescript(_SCHEMA)
        if "owner" not in {r[1] for r in self.db.execute("PRAGMA table_info(jobs)")}:
            self.db.execute(_OWNER)
        if "seq" not in {r[1] for r in self.db.execute("PRAGMA table_info(items)")}:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.execute(_SEQ)
                self.db.execute(_SEQ_BACKFILL, (DONE, FAILED))
        self.db.execute(_SEQ_INDEX)
        if "bytes" not in {r[1] for r in self.db.execute("PRAGMA table_info(jobs)")}:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.execute(_BYTES)
                self.db.execute(_BYTES_BACKFILL)

    @_serialized
    def close(self) -> None:
        self.db.close()

    @_serialized
    def resume(self) -> int:
        """Puts requests a previous router left running back to pending; returns how many."""
        with self.db:
            return self.db.execute("UPDATE items SET status=? WHERE status=?", (PENDING, RUNNING)).rowcount

    def reclaim(self, live: Iterable[str], grace_s: float) -> int:
        """Nothing: one router's store has no other router's requests to take back (0)."""
        return 0

    @_serialized
    def holdings(self, owner: str) -> tuple[int, int]:
        """How many jobs ``owner`` stores, and their bytes."""
        n, size = self.db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM jobs WHERE owner=?",
                                  (owner,)).fetchone()
        return n, size

    def over_limits(self, owner: str, size: int, limits: StoredLimits) -> str | None:
        """Why ``owner`` may not store one more job of ``size`` bytes (None: it may)."""
        n, held = self.holdings(owner)
        return over_limits_message(owner, n, held, size, limits)

    @_serialized
    def submit(self, name: str, requests: list[bytes], owner: str = "", limits: StoredLimits | None = None) -> JobRow:
        """Stores a job of ``requests``; past ``owner``'s ``limits`` (checked in the same
        transaction) raises StoreLimitExceeded and stores nothing."""
        job = uuid.uuid4().hex[:16]
        now = time.time()
        size = sum(len(r) for r in requests)
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            if limits is not None and (problem := self.over_limits(owner, size, limits)) is not None:
                raise StoreLimitExceeded(problem)
            self.db.execute("INSERT INTO jobs (id, name, state, total, created, owner, bytes) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)", (job, name, JOB_QUEUED, len(requests), now, owner, size))
            self.db.executemany("INSERT INTO items (job, idx, request, status) VALUES (?, ?, ?, ?)",
                                [(job, i, r, PENDING) for i, r in enumerate(requests)])
        return self.get(job)

    @_serialized
    def get(self, job: str) -> JobRow | None:
        row = self.db.execute("SELECT id, name, state, total, created, finished, owner, bytes FROM jobs WHERE id=?",
                              (job,)).fetchone()
        if row is None:
            return None
        counts = dict(self.db.execute("SELECT status, COUNT(*) FROM items WHERE job=? GROUP BY status",
                                      (job,)).fetchall())
        return JobRow(row[0], row[1], row[2], row[3], counts.get(DONE, 0), counts.get(FAILED, 0), row[4], row[5],
                      row[6], row[7])

    @_serialized
    def list(self, owner: str | None = None) -> list[JobRow]:
        """Every job, or only ``owner``'s."""
        if owner is None:
            ids = self.db.execute("SELECT id FROM jobs ORDER BY created").fetchall()
        else:
            ids = self.db.execute("SELECT id FROM jobs WHERE owner=? ORDER BY created", (owner,)).fetchall()
        return [self.get(r[0]) for r in ids]

    @_serialized
    def cancel(self, job: str) -> JobRow | None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            if self.db.execute("UPDATE jobs SET state=?, finished=? WHERE id=? AND state IN (?, ?)",
                               (JOB_CANCELLED, time.time(), job, JOB_QUEUED, JOB_RUNNING)).rowcount:
                self.db.execute("UPDATE items SET status=? WHERE job=? AND status=?", (CANCELLED, job, PENDING))
        return self.get(job)

    @_serialized
    def claim(self, n: int,
              skip_owners: frozenset[str] = frozenset()) -> builtins.list[tuple[str, int, bytes, str]]:
        """Up to ``n`` pending requests (job, index, request, owner), now marked
        running: the owners with pending work take turns (each its oldest job
        first), so one tenant's huge job does not hold back every other's.
        Owners in ``skip_owners`` (over their quota) get none."""
        if n <= 0:
            return []
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            owners = [r[0] for r in self.db.execute(
                "SELECT owner FROM jobs WHERE state IN (?, ?) GROUP BY owner ORDER BY MIN(created)",
                (JOB_QUEUED, JOB_RUNNING)) if r[0] not in skip_owners]
            per_owner = [self.db.execute(
                "SELECT i.job, i.idx, i.request, j.owner FROM jobs j JOIN items i ON i.job = j.id "
                "WHERE j.owner=? AND j.state IN (?, ?) AND i.status=? ORDER BY j.created, i.idx LIMIT ?",
                (owner, JOB_QUEUED, JOB_RUNNING, PENDING, n)).fetchall() for owner in owners]
            rows = [row for turn in itertools.zip_longest(*per_owner) for row in turn if row is not None][:n]
            self.db.executemany("UPDATE items SET status=? WHERE job=? AND idx=?",
                                [(RUNNING, job, idx) for job, idx, _, _ in rows])
            for job in {row[0] for row in rows}:
                self.db.execute("UPDATE jobs SET state=? WHERE id=? AND state=?", (JOB_RUNNING, job, JOB_QUEUED))
        return rows

    @_serialized
    def finish(self, job: str, idx: int, result: bytes, ok: bool) -> bool:
        """Stores one request's result, next in the job's ``seq`` order; False
        (and nothing stored) unless it was running."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            seq = self.last_seq(job) + 1  # (job, seq) is indexed: no scan of the job's rows
            if not self.db.execute("UPDATE items SET status=?, result=?, seq=? WHERE job=? AND idx=? AND status=?",
                                   (DONE if ok else FAILED, result, seq, job, idx, RUNNING)).rowcount:
                return False
            self.db.execute("UPDATE jobs SET bytes = bytes + ? WHERE id=?", (len(result), job))
            left = self.db.execute("SELECT EXISTS (SELECT 1 FROM items WHERE job=? AND status IN (?, ?))",
                                   (job, PENDING, RUNNING)).fetchone()[0]  # not a count: O(1), not O(rows left)
            if not left:
                self.db.execute("UPDATE jobs SET state=?, finished=? WHERE id=? AND state=?",
                                (JOB_DONE, time.time(), job, JOB_RUNNING))
        return True

    @_serialized
    def release(self, job: str, idx: int) -> None:
        """A running request that could not run now (router shutting down) goes back to pending."""
        with self.db:
            self.db.execute("UPDATE items SET status=? WHERE job=? AND idx=? AND status=?",
                            (PENDING, job, idx, RUNNING))

    @_serialized
    def state(self, job: str) -> int | None:
        """The job's state alone (one row; :meth:`get` also counts every request's status)."""
        row = self.db.execute("SELECT state FROM jobs WHERE id=?", (job,)).fetchone()
        return None if row is None else row[0]

    @_serialized
    def last_seq(self, job: str) -> int:
        """``seq`` of the job's latest stored result (0: none yet)."""
        return self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM items WHERE job=?", (job,)).fetchone()[0]

    @_serialized
    def results(self, job: str, from_idx: int = 0, after_idx: int = -1, upto_seq: int | None = None,
                limit: int = RESULT_PAGE) -> builtins.list[tuple[int, int, bytes]]:
        """Stored results (seq, index, result) in index order: index >= ``from_idx``
        and > ``after_idx`` (the last one of the previous page), stored no later
        than ``upto_seq`` (None: any); at most ``limit``."""
        upto = self.last_seq(job) if upto_seq is None else upto_seq
        return self.db.execute("SELECT seq, idx, result FROM items WHERE job=? AND idx>=? AND seq<=? "
                               "ORDER BY idx LIMIT ?", (job, max(from_idx, after_idx + 1), upto, limit)).fetchall()

    @_serialized
    def results_after(self, job: str, after_seq: int,
                      limit: int = RESULT_PAGE) -> builtins.list[tuple[int, int, bytes]]:
        """Results (seq, index, result) stored after ``after_seq``, in the order
        they were stored; at most ``limit``. Reads only those rows (through the
        (job, seq) index), however many the job already has."""
        return self.db.execute("SELECT seq, idx, result FROM items INDEXED BY items_by_seq WHERE job=? AND seq>? "
                               "ORDER BY seq LIMIT ?", (job, after_seq, limit)).fetchall()

    @_serialized
    def finished_before(self, before_ts: float) -> builtins.list[JobRow]:
        """Finished jobs (done or cancelled, none of their requests still
        running) that finished before Unix time ``before_ts``, oldest first."""
        ids = self.db.execute(
            "SELECT id FROM jobs WHERE state IN (?, ?) AND finished > 0 AND finished < ? AND NOT EXISTS "
            "(SELECT 1 FROM items WHERE items.job = jobs.id AND items.status = ?) ORDER BY finished",
            (JOB_DONE, JOB_CANCELLED, before_ts, RUNNING)).fetchall()
        return [row for row in (self.get(r[0]) for r in ids) if row is not None]

    @_serialized
    def delete(self, job: str) -> int | None:
        """Deletes the job with its requests and results; returns how many
        requests (None: no such job). Running requests are the caller's to
        stop first (a result stored for a deleted request is dropped)."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            if not self.db.execute("DELETE FROM jobs WHERE id=?", (job,)).rowcount:
                return None
            n = self.db.execute("DELETE FROM items WHERE job=?", (job,)).rowcount
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # old pages out of the -wal file (best effort)
        return n
