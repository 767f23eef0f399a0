"""The usage ledger: the workers' own counters (``WorkerLoad.usage``,
cumulative since each worker process started) turned into per-minute rows
(minute, tenant, site, link, role, worker) in SQLite, and queried grouped
(``Admin.Usage``, ``kvrelay usage``). The router estimates nothing here.

Each heartbeat's counters are compared with the last ones seen from the same
worker incarnation (``WorkerLoad.incarnation``); the differences go to the
minute the heartbeat arrived in. The last-seen values are stored in the same
transaction as the rows they produced, so a router restart neither loses
nor double counts: the first heartbeat after it is compared with what was
stored (work done while the router was down lands in that minute). A
worker restart is a new incarnation, whose counters start from zero.

Heartbeats only touch memory; the rows are written at most every
``flush_interval_s`` on a worker thread (``flush_soon``), and before every
query. A write that fails keeps its rows in memory for the next one. The
database file is the router user's alone (0600; a folder made for it 0700)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from pathlib import Path

from kvrelay.runtime.config import ClusterConfig
from kvrelay.runtime.files import create_private
from kvrelay.runtime.roles import Role
from kvrelay.runtime.topology import link_name
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "kv_bytes", "engine_ns")
"""The counters, as ``TenantUsage`` names them."""
GROUPS = ("tenant", "site", "link", "role", "worker")
"""What rows may be grouped by."""
DEFAULT_BY = ("tenant", "site", "link")
FLUSH_INTERVAL_S = 2.0
SEEN_TTL_S = 7 * 86400.0
"""Last-seen counters of an incarnation silent this long are forgotten."""
MAX_NOTED = 1_000
"""Most (worker, tenant, link) names refused that are logged, once each."""

Counts = tuple[int, ...]
"""One value per name in FIELDS."""
ZERO: Counts = (0,) * len(FIELDS)
SeenKey = tuple[str, str, str, str]
"""(worker, incarnation, tenant, link)."""

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage (
    minute INTEGER NOT NULL, tenant TEXT NOT NULL, site TEXT NOT NULL, link TEXT NOT NULL,
    role TEXT NOT NULL, worker TEXT NOT NULL,
    {", ".join(f"{f} INTEGER NOT NULL DEFAULT 0" for f in FIELDS)},
    PRIMARY KEY (minute, tenant, site, link, role, worker));
CREATE TABLE IF NOT EXISTS seen (
    worker TEXT NOT NULL, incarnation TEXT NOT NULL, tenant TEXT NOT NULL, link TEXT NOT NULL,
    {", ".join(f"{f} INTEGER NOT NULL" for f in FIELDS)}, updated REAL NOT NULL,
    PRIMARY KEY (worker, incarnation, tenant, link));
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_ADD_ROW = (f"INSERT INTO usage (minute, tenant, site, link, role, worker, {', '.join(FIELDS)}) "
            f"VALUES ({', '.join('?' * (6 + len(FIELDS)))}) "
            "ON CONFLICT (minute, tenant, site, link, role, worker) DO UPDATE SET "
            + ", ".join(f"{f} = {f} + excluded.{f}" for f in FIELDS))
_SET_SEEN = (f"INSERT OR REPLACE INTO seen (worker, incarnation, tenant, link, {', '.join(FIELDS)}, updated) "
             f"VALUES ({', '.join('?' * (5 + len(FIELDS)))})")


@dataclass(slots=True, frozen=True)
class UsageNames:
    """The tenants and links a worker's counters may name: the config's (a worker cannot charge a
    tenant that does not exist, nor a link between sites there are not)."""

    tenants: frozenset[str]
    links: frozenset[str]
    """Every pair of the config's sites ("local" within one), and "" (no KV moved)."""

    @classmethod
    def of(cls, cfg: ClusterConfig, anonymous: str) -> UsageNames:
        """The names of ``cfg``; ``anonymous``: what anonymous callers are counted as."""
        sites = [s.name for s in cfg.sites]
        return cls(frozenset({anonymous, *(t.name for t in cfg.tenants)}),
                   frozenset({"", *(link_name(a, b) for a in sites for b in sites)}))

    def refusal(self, u: wpb.TenantUsage) -> str | None:
        """Why ``u`` is not taken (None: it is)."""
        if u.tenant not in self.tenants:
            return f"tenant {u.tenant[:100]!r} is not in the config's tenants"
        if u.link not in self.links:
            return f"link {u.link[:100]!r} is not between two of the config's sites"
        return None


@dataclass(slots=True, frozen=True)
class RowKey:
    minute: int
    """Unix time of the minute's start."""
    tenant: str
    site: str
    link: str
    role: str
    worker: str


@dataclass(slots=True)
class UsageRow:
    """One group's totals (fields as ``kvrelay.v1.UsageRow``; "" for what it is not grouped by)."""

    tenant: str = ""
    site: str = ""
    link: str = ""
    role: str = ""
    worker: str = ""
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_bytes: int = 0
    prefill_worker_s: float = 0.0
    decode_worker_s: float = 0.0


@dataclass(slots=True)
class UsageReport:
    rows: list[UsageRow]
    since_unix: float
    """The first minute the rows cover (the one asked for when there are none)."""
    until_unix: float
    """The last heartbeat they include (0: none since the router started)."""


def grouping(by: Iterable[str]) -> tuple[str, ...]:
    """The group-by names, checked (ValueError naming a refused one); empty: tenant, site, link."""
    out: list[str] = []
    for name in by:
        if name not in GROUPS:
            raise ValueError(f"cannot group usage by {name!r} (one of: {', '.join(GROUPS)})")
        if name not in out:
            out.append(name)
    return tuple(out) or DEFAULT_BY


def counts_of(u: wpb.TenantUsage) -> Counts:
    return tuple(int(getattr(u, f)) for f in FIELDS)


def delta(cur: Counts, prev: Counts) -> Counts:
    """What happened between two cumulative readings; a counter that went back
    (it cannot within one incarnation) counts from zero again."""
    return tuple(c - p if c >= p else c for c, p in zip(cur, prev))


def _add(a: Counts, b: Counts) -> Counts:
    return tuple(x + y for x, y in zip(a, b))


def open_private_db(path: str | None) -> sqlite3.Connection:
    """The ledger's database (``None``: in memory); a file is made 0600, its folder 0700 when made here."""
    if path is None:
        return sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    p = Path(path)
    create_private(p)  # SQLite gives its -wal and -shm files the database's mode
    db = sqlite3.connect(str(p), isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class UsageLedger:
    def __init__(self, path: str | None, clock: Callable[[], float] = time.time,
                 flush_interval_s: float = FLUSH_INTERVAL_S, names: UsageNames | None = None) -> None:
        """``path``: the SQLite file (None: in memory, lost with the router); ``clock``: unix time;
        ``names``: the tenants and links counters may name (the router passes its config's; None:
        any, for a ledger read on its own)."""
        self.clock = clock
        self.names = names
        self.refused = 0
        """Counter entries not taken because they named what the config does not hold."""
        self._noted: set[tuple[str, str, str]] = set()
        self.flush_interval_s = flush_interval_s
        self.db = open_private_db(path)
        self.db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        """Guards the in-memory state below (heartbeats on the loop, flushes on a thread)."""
        self._db_lock = threading.Lock()
        """One writer or reader of the connection at a time."""
        self._last: dict[SeenKey, Counts] = {}
        """The last cumulative counters seen, per worker incarnation, tenant and link."""
        self._touched: dict[tuple[str, str], float] = {}
        """(worker, incarnation) -> when it last reported (unix)."""
        self._pending: dict[RowKey, Counts] = {}
        self._dirty: set[SeenKey] = set()
        self._last_beat = 0.0
        self._flushed_at = time.monotonic()
        self._flushing: asyncio.Future | None = None
        self._load_seen()

    def _load_seen(self) -> None:
        for row in self.db.execute(f"SELECT worker, incarnation, tenant, link, {', '.join(FIELDS)}, updated FROM seen"):
            key, counts, updated = tuple(row[:4]), tuple(row[4:4 + len(FIELDS)]), row[-1]
            self._last[key] = counts
            self._touched[key[:2]] = max(updated, self._touched.get(key[:2], 0.0))

    # -- heartbeats -----------------------------------------------------------------------------------------------
    def observe(self, worker_id: str, site: str, role: Role, load: wpb.WorkerLoad) -> None:
        """Takes one heartbeat's (or a leaving worker's final) counters from
        ``worker_id`` at ``site`` (``role``: prefill or decode). Memory only."""
        now = self.clock()
        minute = int(now // 60) * 60
        inc = load.incarnation
        with self._lock:
            self._last_beat = max(self._last_beat, now)
            if not load.usage:
                return
            self._touched[(worker_id, inc)] = now
            for u in load.usage:
                if self.names is not None and (why := self.names.refusal(u)) is not None:
                    self._refuse(worker_id, u, why)
                    continue
                key = (worker_id, inc, u.tenant, u.link)
                cur = counts_of(u)
                d = delta(cur, self._last.get(key, ZERO))
                if not any(d):
                    continue
                row = RowKey(minute, u.tenant, site, u.link, role, worker_id)
                self._pending[row] = _add(self._pending.get(row, ZERO), d)
                self._last[key] = cur
                self._dirty.add(key)

    def _refuse(self, worker_id: str, u: wpb.TenantUsage, why: str) -> None:
        """Counts (and logs once per worker, tenant and link) an entry not taken; the lock held."""
        self.refused += 1
        noted = (worker_id, u.tenant, u.link)
        if noted not in self._noted and len(self._noted) < MAX_NOTED:
            self._noted.add(noted)
            log.warning("usage counters of worker %s not taken: %s", worker_id, why)

    def take_heartbeat(self, worker_id: str, site: str, role: Role, load: wpb.WorkerLoad) -> None:
        """A worker's reported load (the registry's ``on_load``): its counters
        in memory, written to disk on a thread, in batches."""
        self.observe(worker_id, site, role, load)
        self.flush_soon()

    def flush_soon(self) -> None:
        """Starts a flush on a worker thread when one is due and none runs
        (without a running event loop, nothing: the next query writes the rows)."""
        if self._flushing is not None and not self._flushing.done():
            return
        if time.monotonic() - self._flushed_at < self.flush_interval_s:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._flushed_at = time.monotonic()
        self._flushing = loop.run_in_executor(None, self.flush)

    def _take(self) -> tuple[dict[RowKey, Counts], list[tuple], list[tuple[str, str]]]:
        """What to write (rows, last-seen values, expired incarnations), taken out of memory together."""
        with self._lock:
            pending, self._pending = self._pending, {}
            dirty, self._dirty = self._dirty, set()
            seen = [(*k, *self._last[k], self._touched.get(k[:2], 0.0)) for k in dirty]
            cutoff = self.clock() - SEEN_TTL_S
            expired = [wi for wi, t in self._touched.items() if t < cutoff]
            for wi in expired:
                del self._touched[wi]
            if expired:
                gone = set(expired)
                self._last = {k: v for k, v in self._last.items() if k[:2] not in gone}
            return pending, seen, expired

    def flush(self) -> bool:
        """Writes what heartbeats brought since the last flush, in one
        transaction (thread-safe). False, with everything kept for the next
        flush, when the write failed."""
        with self._db_lock:
            pending, seen, expired = self._take()
            if not (pending or seen or expired):
                return True
            try:
                with self.db:
                    self.db.execute("BEGIN IMMEDIATE")
                    self.db.executemany(_ADD_ROW, [(k.minute, k.tenant, k.site, k.link, k.role, k.worker, *c)
                                                   for k, c in pending.items()])
                    self.db.executemany(_SET_SEEN, seen)
                    self.db.executemany("DELETE FROM seen WHERE worker = ? AND incarnation = ?", expired)
            except sqlite3.Error as exc:
                log.warning("usage ledger: could not write %d rows (kept for the next try): %s", len(pending), exc)
                with self._lock:
                    for k, c in pending.items():
                        self._pending[k] = _add(self._pending.get(k, ZERO), c)
                    self._dirty.update(tuple(s[:4]) for s in seen)
                return False
            return True

    # -- the router's own durable counters (retries, migrations) --------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Every durable counter's value (router/core/observe.py keeps retries and migrations here)."""
        with self._db_lock:
            return dict(self.db.execute("SELECT name, value FROM counters").fetchall())

    def add_counter(self, name: str, n: int) -> None:
        """Adds ``n`` to counter ``name`` at once (one small committed write: these are rare
        events whose count must survive a router crash)."""
        try:
            with self._db_lock, self.db:
                self.db.execute("INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT (name) "
                                "DO UPDATE SET value = value + excluded.value", (name, n))
        except sqlite3.Error as exc:
            log.warning("usage ledger: could not count %s: %s", name, exc)

    # -- queries --------------------------------------------------------------------------------------------------
    def query(self, since_unix: float = 0.0, by: Iterable[str] = (), tenant: str = "") -> UsageReport:
        """Totals per group (``grouping(by)``) over the minutes from
        ``since_unix`` on, of one ``tenant`` or all (""); blocking (see ``report``)."""
        groups = grouping(by)
        self.flush()
        since_minute = int(max(0.0, since_unix) // 60) * 60
        cols = ", ".join(groups)
        args: list[int | str]
        where, args = "minute >= ?", [since_minute]
        if tenant:
            where, args = where + " AND tenant = ?", [*args, tenant]
        sums = ", ".join(f"SUM({f})" for f in FIELDS[:-1])
        sql = (f"SELECT {cols}, {sums}, SUM(CASE WHEN role = 'prefill' THEN engine_ns ELSE 0 END), "
               f"SUM(CASE WHEN role = 'prefill' THEN 0 ELSE engine_ns END), MIN(minute) "
               f"FROM usage WHERE {where} GROUP BY {cols} ORDER BY {cols}")
        with self._db_lock:
            found = self.db.execute(sql, args).fetchall()
        n = len(groups)
        rows = [UsageRow(**dict(zip(groups, r[:n])), **dict(zip(FIELDS[:-1], r[n:n + 5])),
                         prefill_worker_s=r[n + 5] / 1e9, decode_worker_s=r[n + 6] / 1e9) for r in found]
        first = min((r[-1] for r in found), default=since_minute)
        with self._lock:
            until = self._last_beat
        return UsageReport(rows, float(first), until)

    async def report(self, since_unix: float = 0.0, by: Iterable[str] = (), tenant: str = "") -> UsageReport:
        """:meth:`query` on a worker thread (the event loop never waits on the disk)."""
        return await asyncio.to_thread(self.query, since_unix, tuple(by), tenant)

    async def close(self) -> None:
        """Writes what is left and closes the database."""
        if self._flushing is not None:
            await asyncio.wait({self._flushing}, timeout=10.0)
        await asyncio.to_thread(self.flush)
        with self._db_lock:
            self.db.close()


def usage_response(report: UsageReport) -> apb.UsageResponse:
    """The ledger's answer as ``Admin.Usage`` returns it."""
    return apb.UsageResponse(
        rows=[apb.UsageRow(**{f.name: getattr(r, f.name) for f in fields(UsageRow)}) for r in report.rows],
        since_unix=report.since_unix, until_unix=report.until_unix)
