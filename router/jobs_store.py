"""Durable storage of batch jobs: an embedded SQLite database at the router.

Each request of a job is a row that moves pending -> running -> done or
failed (or cancelled). A result is written in the same transaction that
moves its row out of running, and only from running, so a result is stored
exactly once. On start, rows left running by a router that died go back to
pending: unfinished jobs resume, finished requests are never redone.

Synchronous and single-threaded by design: the router calls it through one
worker thread (router/jobs.py), so the event loop never waits on the disk."""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

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


class JobStore:
    def __init__(self, path: str | Path) -> None:
        """Opens (creating if needed) the database at ``path`` (":memory:" = not durable)."""
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)
        if "owner" not in {r[1] for r in self.db.execute("PRAGMA table_info(jobs)")}:
            self.db.execute(_OWNER)
        if "seq" not in {r[1] for r in self.db.execute("PRAGMA table_info(items)")}:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.execute(_SEQ)
                self.db.execute(_SEQ_BACKFILL, (DONE, FAILED))
        self.db.execute(_SEQ_INDEX)

    def close(self) -> None:
        self.db.close()

    def resume(self) -> int:
        """Puts requests a previous router left running back to pending; returns how many."""
        with self.db:
            return self.db.execute("UPDATE items SET status=? WHERE status=?", (PENDING, RUNNING)).rowcount

    def submit(self, name: str, requests: list[bytes], owner: str = "") -> JobRow:
        job = uuid.uuid4().hex[:16]
        now = time.time()
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("INSERT INTO jobs (id, name, state, total, created, owner) VALUES (?, ?, ?, ?, ?, ?)",
                            (job, name, JOB_QUEUED, len(requests), now, owner))
            self.db.executemany("INSERT INTO items (job, idx, request, status) VALUES (?, ?, ?, ?)",
                                [(job, i, r, PENDING) for i, r in enumerate(requests)])
        return self.get(job)

    def get(self, job: str) -> JobRow | None:
        row = self.db.execute("SELECT id, name, state, total, created, finished, owner FROM jobs WHERE id=?",
                              (job,)).fetchone()
        if row is None:
            return None
        counts = dict(self.db.execute("SELECT status, COUNT(*) FROM items WHERE job=? GROUP BY status",
                                      (job,)).fetchall())
        return JobRow(row[0], row[1], row[2], row[3], counts.get(DONE, 0), counts.get(FAILED, 0), row[4], row[5],
                      row[6])

    def list(self, owner: str | None = None) -> list[JobRow]:
        """Every job, or only ``owner``'s."""
        if owner is None:
            ids = self.db.execute("SELECT id FROM jobs ORDER BY created").fetchall()
        else:
            ids = self.db.execute("SELECT id FROM jobs WHERE owner=? ORDER BY created", (owner,)).fetchall()
        return [self.get(r[0]) for r in ids]

    def cancel(self, job: str) -> JobRow | None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            if self.db.execute("UPDATE jobs SET state=?, finished=? WHERE id=? AND state IN (?, ?)",
                               (JOB_CANCELLED, time.time(), job, JOB_QUEUED, JOB_RUNNING)).rowcount:
                self.db.execute("UPDATE items SET status=? WHERE job=? AND status=?", (CANCELLED, job, PENDING))
        return self.get(job)

    def claim(self, n: int) -> list[tuple[str, int, bytes, str]]:
        """Up to ``n`` pending requests (job, index, request, owner), oldest job first, now marked running."""
        if n <= 0:
            return []
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            rows = self.db.execute(
                "SELECT i.job, i.idx, i.request, j.owner FROM items i JOIN jobs j ON j.id = i.job "
                "WHERE i.status=? AND j.state IN (?, ?) ORDER BY j.created, i.idx LIMIT ?",
                (PENDING, JOB_QUEUED, JOB_RUNNING, n)).fetchall()
            self.db.executemany("UPDATE items SET status=? WHERE job=? AND idx=?",
                                [(RUNNING, job, idx) for job, idx, _, _ in rows])
            for job in {row[0] for row in rows}:
                self.db.execute("UPDATE jobs SET state=? WHERE id=? AND state=?", (JOB_RUNNING, job, JOB_QUEUED))
        return rows

    def finish(self, job: str, idx: int, result: bytes, ok: bool) -> bool:
        """Stores one request's result, next in the job's ``seq`` order; False
        (and nothing stored) unless it was running."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            seq = self.last_seq(job) + 1  # (job, seq) is indexed: no scan of the job's rows
            if not self.db.execute("UPDATE items SET status=?, result=?, seq=? WHERE job=? AND idx=? AND status=?",
                                   (DONE if ok else FAILED, result, seq, job, idx, RUNNING)).rowcount:
                return False
            left = self.db.execute("SELECT EXISTS (SELECT 1 FROM items WHERE job=? AND status IN (?, ?))",
                                   (job, PENDING, RUNNING)).fetchone()[0]  # not a count: O(1), not O(rows left)
            if not left:
                self.db.execute("UPDATE jobs SET state=?, finished=? WHERE id=? AND state=?",
                                (JOB_DONE, time.time(), job, JOB_RUNNING))
        return True

    def release(self, job: str, idx: int) -> None:
        """A running request that could not run now (router shutting down) goes back to pending."""
        with self.db:
            self.db.execute("UPDATE items SET status=? WHERE job=? AND idx=? AND status=?",
                            (PENDING, job, idx, RUNNING))

    def state(self, job: str) -> int | None:
        """The job's state alone (one row; :meth:`get` also counts every request's status)."""
        row = self.db.execute("SELECT state FROM jobs WHERE id=?", (job,)).fetchone()
        return None if row is None else row[0]

    def last_seq(self, job: str) -> int:
        """``seq`` of the job's latest stored result (0: none yet)."""
        return self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM items WHERE job=?", (job,)).fetchone()[0]

    def results(self, job: str, from_idx: int = 0, after_idx: int = -1, upto_seq: int | None = None,
                limit: int = RESULT_PAGE) -> list[tuple[int, int, bytes]]:
        """Stored results (seq, index, result) in index order: index >= ``from_idx``
        and > ``after_idx`` (the last one of the previous page), stored no later
        than ``upto_seq`` (None: any); at most ``limit``."""
        upto = self.last_seq(job) if upto_seq is None else upto_seq
        return self.db.execute("SELECT seq, idx, result FROM items WHERE job=? AND idx>=? AND seq<=? "
                               "ORDER BY idx LIMIT ?", (job, max(from_idx, after_idx + 1), upto, limit)).fetchall()

    def results_after(self, job: str, after_seq: int, limit: int = RESULT_PAGE) -> list[tuple[int, int, bytes]]:
        """Results (seq, index, result) stored after ``after_seq``, in the order
        they were stored; at most ``limit``. Reads only those rows (through the
        (job, seq) index), however many the job already has."""
        return self.db.execute("SELECT seq, idx, result FROM items INDEXED BY items_by_seq WHERE job=? AND seq>? "
                               "ORDER BY seq LIMIT ?", (job, after_seq, limit)).fetchall()
