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
        """Stores one request's result; False (and nothing stored) unless it was running."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            if not self.db.execute("UPDATE items SET status=?, result=? WHERE job=? AND idx=? AND status=?",
                                   (DONE if ok else FAILED, result, job, idx, RUNNING)).rowcount:
                return False
            left = self.db.execute("SELECT COUNT(*) FROM items WHERE job=? AND status IN (?, ?)",
                                   (job, PENDING, RUNNING)).fetchone()[0]
            if left == 0:
                self.db.execute("UPDATE jobs SET state=?, finished=? WHERE id=? AND state=?",
                                (JOB_DONE, time.time(), job, JOB_RUNNING))
        return True

    def release(self, job: str, idx: int) -> None:
        """A running request that could not run now (router shutting down) goes back to pending."""
        with self.db:
            self.db.execute("UPDATE items SET status=? WHERE job=? AND idx=? AND status=?",
                            (PENDING, job, idx, RUNNING))

    def results(self, job: str, from_idx: int = 0) -> list[tuple[int, bytes]]:
        return self.db.execute("SELECT idx, result FROM items WHERE job=? AND idx>=? AND status IN (?, ?) "
                               "ORDER BY idx", (job, from_idx, DONE, FAILED)).fetchall()
