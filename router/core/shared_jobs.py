"""Batch jobs shared by the routers of a deployment with several: the same store as
jobs_store.py (the same methods, states and guarantees), kept in PostgreSQL so that
no job lives on one router's disk and any router continues another's (any that may
read the job's tenant's prompts: router/frontends/jobs.py skips the others' owners).

Why PostgreSQL and not etcd: a job holds its prompts and results (up to a tenant's
``max_stored_job_bytes``, gigabytes in all), past what etcd is built for (1.5 MiB a
value, a few GiB in all, every byte in every member's memory map); PostgreSQL keeps
them on disk, streams them to standbys, and gives the row locks that let several
routers take requests from one queue without taking the same one twice.

Who runs what: a router takes pending requests (``FOR UPDATE SKIP LOCKED``: two
routers never take the same one) and marks them running *under its own name*
(``holder``). A request's lease is its holder's lease in etcd: while that router is
a member (router/cluster/membership.py), its requests are its own; once its etcd
lease ends (it died, or lost etcd), any live router puts its running requests back
to pending (:meth:`SharedJobStore.reclaim`) and they run again. A result is stored
only by the request's holder and only while it runs, in the transaction that ends
it: a router that comes back from the dead after its requests moved on stores
nothing, so every result is stored exactly once.

Results are numbered (``seq``) by a per-job counter updated in the storing
transaction, which locks the job's row: results commit in ``seq`` order, so a
follower reading "after seq n" never skips one.

Synchronous, one connection, each method under the store's lock, called from the
router's jobs thread (router/frontends/jobs.py) like :class:`JobStore`. Every
statement has a deadline (``statement_timeout``, ``lock_timeout``); a connection
that broke is opened again on the next call, and a call that fails for want of the
database raises :class:`JobStoreUnavailable` naming it."""

from __future__ import annotations

import builtins
import functools
import itertools
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import psycopg

from kvrelay.router.core.jobs_store import (
    CANCELLED,
    DONE,
    FAILED,
    JOB_CANCELLED,
    JOB_DONE,
    JOB_QUEUED,
    JOB_RUNNING,
    PENDING,
    RESULT_PAGE,
    RUNNING,
    JobRow,
    JobStoreUnavailable,
    StoredLimits,
    StoreLimitExceeded,
    over_limits_message,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, state INTEGER NOT NULL, total INTEGER NOT NULL,
    created DOUBLE PRECISION NOT NULL, finished DOUBLE PRECISION NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT '', bytes BIGINT NOT NULL DEFAULT 0, last_seq BIGINT NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, created);
CREATE TABLE IF NOT EXISTS items (
    job TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE, idx INTEGER NOT NULL, request BYTEA NOT NULL,
    status INTEGER NOT NULL, result BYTEA, seq BIGINT, holder TEXT, claimed_at DOUBLE PRECISION,
    PRIMARY KEY (job, idx));
CREATE INDEX IF NOT EXISTS items_by_status ON items (status, job, idx);
CREATE INDEX IF NOT EXISTS items_by_seq ON items (job, seq);
"""
NOW = "EXTRACT(EPOCH FROM clock_timestamp())"
"""The database's clock: the one every router's claims and reclaims are measured by."""


def _connected(method):
    """``method`` under the store's lock, on an open connection; JobStoreUnavailable when the
    database cannot be reached or a statement ran past its deadline."""
    @functools.wraps(method)
    def call(self: SharedJobStore, *args, **kwargs):
        with self._lock:
            try:
                self._open()
                return method(self, *args, **kwargs)
            except psycopg.OperationalError as exc:
                if self._conn is not None and self._conn.broken:
                    self._conn = None
                raise JobStoreUnavailable(f"the jobs database ({self.where}) did not answer: "
                                          f"{str(exc).strip().splitlines()[0][:300]}") from None
    return call


class SharedJobStore:
    """Jobs in PostgreSQL, taken and stored by router ``holder`` (module docstring)."""

    def __init__(self, conninfo: str, holder: str, where: str, timeout_s: float = 5.0) -> None:
        """``conninfo``: libpq's connection string (every server, ``target_session_attrs=read-write``);
        ``holder``: this router's name; ``where``: the servers, as errors name them."""
        self.conninfo, self.holder, self.where, self.timeout_s = conninfo, holder, where, timeout_s
        self._lock = threading.RLock()
        self._conn: psycopg.Connection | None = None
        with self._lock:
            try:
                self._open()
            except psycopg.OperationalError as exc:
                raise JobStoreUnavailable(f"the jobs database ({where}) cannot be reached: "
                                          f"{str(exc).strip()[:600]}") from None

    def _open(self) -> None:
        if self._conn is not None and not self._conn.closed:
            return
        ms = int(self.timeout_s * 1000)
        conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=max(1, int(self.timeout_s)),
                               options=f"-c statement_timeout={ms} -c lock_timeout={ms}")
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(7261)")  # one router creates the schema at a time
            conn.execute(SCHEMA)
        self._conn = conn

    @property
    def _db(self) -> psycopg.Connection:
        assert self._conn is not None  # _connected opened it
        return self._conn

    def _one(self, sql: str, params: Iterable[Any] = ()) -> tuple:
        row = self._db.execute(sql, tuple(params)).fetchone()
        assert row is not None  # aggregate queries always answer one row
        return row

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @_connected
    def resume(self) -> int:
        """Requests this router (by its name: an earlier run of it) left running go back to pending."""
        return self._db.execute("UPDATE items SET status=%s, holder=NULL WHERE status=%s AND holder=%s",
                                (PENDING, RUNNING, self.holder)).rowcount

    @_connected
    def reclaim(self, live: Iterable[str], grace_s: float) -> int:
        """Requests running at a router not in ``live`` (its etcd lease ended) go back to pending,
        except those taken in the last ``grace_s`` (a router too new to be known here yet)."""
        return self._db.execute(
            f"UPDATE items SET status=%s, holder=NULL WHERE status=%s AND NOT (holder = ANY(%s)) "
            f"AND claimed_at < {NOW} - %s", (PENDING, RUNNING, sorted(set(live) | {self.holder}), grace_s)).rowcount

    @_connected
    def holdings(self, owner: str) -> tuple[int, int]:
        """How many jobs ``owner`` stores, and their bytes."""
        n, size = self._one("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM jobs WHERE owner=%s", (owner,))
        return int(n), int(size)

    def over_limits(self, owner: str, size: int, limits: StoredLimits) -> str | None:
        """Why ``owner`` may not store one more job of ``size`` bytes (None: it may)."""
        n, held = self.holdings(owner)
        return over_limits_message(owner, n, held, size, limits)

    @_connected
    def submit(self, name: str, requests: list[bytes], owner: str = "", limits: StoredLimits | None = None) -> JobRow:
        """Stores a job of ``requests``; past ``owner``'s ``limits`` (checked under a lock on the
        owner, so two routers' submissions cannot both pass) raises StoreLimitExceeded."""
        job = uuid.uuid4().hex[:16]
        size = sum(len(r) for r in requests)
        with self._db.transaction():
            self._db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (owner,))
            if limits is not None and (problem := self.over_limits(owner, size, limits)) is not None:
                raise StoreLimitExceeded(problem)
            self._db.execute("INSERT INTO jobs (id, name, state, total, created, owner, bytes) "
                             "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                             (job, name, JOB_QUEUED, len(requests), time.time(), owner, size))
            with self._db.cursor() as cur:
                cur.executemany("INSERT INTO items (job, idx, request, status) VALUES (%s, %s, %s, %s)",
                                [(job, i, r, PENDING) for i, r in enumerate(requests)])
        row = self.get(job)
        assert row is not None  # just stored
        return row

    @_connected
    def get(self, job: str) -> JobRow | None:
        row = self._db.execute("SELECT id, name, state, total, created, finished, owner, bytes FROM jobs "
                               "WHERE id=%s", (job,)).fetchone()
        if row is None:
            return None
        counts: dict[int, int] = dict(self._db.execute(
            "SELECT status, COUNT(*) FROM items WHERE job=%s GROUP BY status", (job,)).fetchall())
        return JobRow(row[0], row[1], row[2], row[3], counts.get(DONE, 0), counts.get(FAILED, 0), row[4], row[5],
                      row[6], int(row[7]))

    @_connected
    def list(self, owner: str | None = None) -> builtins.list[JobRow]:
        """Every job, or only ``owner``'s."""
        if owner is None:
            ids = self._db.execute("SELECT id FROM jobs ORDER BY created").fetchall()
        else:
            ids = self._db.execute("SELECT id FROM jobs WHERE owner=%s ORDER BY created", (owner,)).fetchall()
        return [r for r in (self.get(i[0]) for i in ids) if r is not None]

    @_connected
    def cancel(self, job: str) -> JobRow | None:
        with self._db.transaction():
            if self._db.execute("UPDATE jobs SET state=%s, finished=%s WHERE id=%s AND state IN (%s, %s)",
                                (JOB_CANCELLED, time.time(), job, JOB_QUEUED, JOB_RUNNING)).rowcount:
                self._db.execute("UPDATE items SET status=%s WHERE job=%s AND status=%s", (CANCELLED, job, PENDING))
        return self.get(job)

    @_connected
    def claim(self, n: int,
              skip_owners: frozenset[str] = frozenset()) -> builtins.list[tuple[str, int, bytes, str]]:
        """Up to ``n`` pending requests (job, index, request, owner), now running here: owners with
        pending work take turns (each its oldest job first); ``skip_owners`` get none. Requests
        another router is taking at this moment are skipped, never waited for."""
        if n <= 0:
            return []
        with self._db.transaction():
            owners = [r[0] for r in self._db.execute(
                "SELECT owner FROM jobs WHERE state IN (%s, %s) GROUP BY owner ORDER BY MIN(created)",
                (JOB_QUEUED, JOB_RUNNING)) if r[0] not in skip_owners]
            per_owner = [self._db.execute(
                "SELECT i.job, i.idx, i.request, j.owner FROM items i JOIN jobs j ON i.job = j.id "
                "WHERE j.owner=%s AND j.state IN (%s, %s) AND i.status=%s ORDER BY j.created, i.idx LIMIT %s "
                "FOR UPDATE OF i SKIP LOCKED", (owner, JOB_QUEUED, JOB_RUNNING, PENDING, n)).fetchall()
                for owner in owners]
            rows = [row for turn in itertools.zip_longest(*per_owner) for row in turn if row is not None][:n]
            with self._db.cursor() as cur:
                cur.executemany(f"UPDATE items SET status=%s, holder=%s, claimed_at={NOW} WHERE job=%s AND idx=%s",
                                [(RUNNING, self.holder, job, idx) for job, idx, _, _ in rows])
            for job in {row[0] for row in rows}:
                self._db.execute("UPDATE jobs SET state=%s WHERE id=%s AND state=%s", (JOB_RUNNING, job, JOB_QUEUED))
        return [(job, idx, bytes(req), owner) for job, idx, req, owner in rows]

    @_connected
    def finish(self, job: str, idx: int, result: bytes, ok: bool) -> bool:
        """Stores one request's result, next in the job's ``seq`` order; False (and nothing
        stored) unless it runs here (another router took it over, or the job was deleted)."""
        with self._db.transaction():
            mine = self._db.execute("SELECT 1 FROM items WHERE job=%s AND idx=%s AND status=%s AND holder=%s "
                                    "FOR UPDATE", (job, idx, RUNNING, self.holder)).fetchone()
            if mine is None:
                return False
            seq = self._one("UPDATE jobs SET last_seq = last_seq + 1, bytes = bytes + %s WHERE id=%s "
                            "RETURNING last_seq", (len(result), job))[0]
            self._db.execute("UPDATE items SET status=%s, result=%s, seq=%s, holder=NULL WHERE job=%s AND idx=%s",
                             (DONE if ok else FAILED, result, seq, job, idx))
            left = self._one("SELECT EXISTS (SELECT 1 FROM items WHERE job=%s AND status IN (%s, %s))",
                             (job, PENDING, RUNNING))[0]
            if not left:
                self._db.execute("UPDATE jobs SET state=%s, finished=%s WHERE id=%s AND state=%s",
                                 (JOB_DONE, time.time(), job, JOB_RUNNING))
        return True

    @_connected
    def release(self, job: str, idx: int) -> None:
        """A request running here that could not run now goes back to pending."""
        self._db.execute("UPDATE items SET status=%s, holder=NULL WHERE job=%s AND idx=%s AND status=%s "
                         "AND holder=%s", (PENDING, job, idx, RUNNING, self.holder))

    @_connected
    def state(self, job: str) -> int | None:
        row = self._db.execute("SELECT state FROM jobs WHERE id=%s", (job,)).fetchone()
        return None if row is None else row[0]

    @_connected
    def last_seq(self, job: str) -> int:
        row = self._db.execute("SELECT last_seq FROM jobs WHERE id=%s", (job,)).fetchone()
        return 0 if row is None else int(row[0])

    @_connected
    def results(self, job: str, from_idx: int = 0, after_idx: int = -1, upto_seq: int | None = None,
                limit: int = RESULT_PAGE) -> builtins.list[tuple[int, int, bytes]]:
        """As :meth:`JobStore.results`."""
        upto = self.last_seq(job) if upto_seq is None else upto_seq
        rows = self._db.execute("SELECT seq, idx, result FROM items WHERE job=%s AND idx>=%s AND seq<=%s "
                                "ORDER BY idx LIMIT %s", (job, max(from_idx, after_idx + 1), upto, limit)).fetchall()
        return [(int(s), i, bytes(r)) for s, i, r in rows]

    @_connected
    def results_after(self, job: str, after_seq: int,
                      limit: int = RESULT_PAGE) -> builtins.list[tuple[int, int, bytes]]:
        """As :meth:`JobStore.results_after` (through the (job, seq) index)."""
        rows = self._db.execute("SELECT seq, idx, result FROM items WHERE job=%s AND seq>%s ORDER BY seq LIMIT %s",
                                (job, after_seq, limit)).fetchall()
        return [(int(s), i, bytes(r)) for s, i, r in rows]

    @_connected
    def finished_before(self, before_ts: float) -> builtins.list[JobRow]:
        """As :meth:`JobStore.finished_before`."""
        ids = self._db.execute(
            "SELECT id FROM jobs WHERE state IN (%s, %s) AND finished > 0 AND finished < %s AND NOT EXISTS "
            "(SELECT 1 FROM items WHERE items.job = jobs.id AND items.status = %s) ORDER BY finished",
            (JOB_DONE, JOB_CANCELLED, before_ts, RUNNING)).fetchall()
        return [row for row in (self.get(r[0]) for r in ids) if row is not None]

    @_connected
    def delete(self, job: str) -> int | None:
        """As :meth:`JobStore.delete` (a result a router stores later for it is refused)."""
        with self._db.transaction():
            n = self._db.execute("DELETE FROM items WHERE job=%s", (job,)).rowcount
            if not self._db.execute("DELETE FROM jobs WHERE id=%s", (job,)).rowcount:
                return None
        return n


def conninfo(endpoints: list[str], database: str, user: str, tls_files: tuple[str, str, str] | None) -> str:
    """libpq's connection string for ``endpoints`` (the writable one chosen at each connect);
    ``tls_files``: (CA, certificate, key) for verify-full TLS with a client certificate."""
    hosts = ",".join(ep.rpartition(":")[0] for ep in endpoints)
    ports = ",".join(ep.rpartition(":")[2] for ep in endpoints)
    info = f"host={hosts} port={ports} dbname={database} user={user} target_session_attrs=read-write"
    if tls_files is not None:
        ca, cert, key = tls_files
        info += f" sslmode=verify-full sslrootcert={ca} sslcert={cert} sslkey={key}"
    return info


