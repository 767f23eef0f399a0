"""The router's audit records written from a thread of their own: callers on
the event loop only queue a record, and the thread writes them in order in
batches, each batch made durable with one fsync (group commit). A record
costs the loop a queue put instead of a ~4 ms fsync (measured on this
machine's disk, benchmarks/RESULTS.md).

A record that cannot be written (disk full, a closed log, or anything
unexpected) is logged as an error with its kind and the request or action
it describes; serving goes on (the audit log is evidence, not a gate), and
so does the thread. At most :data:`MAX_QUEUED` records wait: beyond that
:meth:`AuditWriter.append` drops them (counted in ``dropped``, an error
logged at most once a second), and the next batch written ends with a
``recovery`` record ``{action: "records dropped", count}``.

With a :class:`HeadSigner` (router/governance/audit_heads.py) the writer signs
the log's head when it opens the log, after a batch once ``head_interval_s``
has passed since the last signed head (when the head moved), and when it
closes the log."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvrelay.router.core.records import RecordKind
from kvrelay.router.governance.audit import AuditError, AuditLog, SweepResult, iso_time
from kvrelay.router.governance.audit_heads import HeadSigner, HeadState

log = logging.getLogger(__name__)

MAX_BATCH = 512
"""Most records written before one fsync."""
MAX_QUEUED = 100_000
"""Most records (of :meth:`AuditWriter.append`) waiting to be written; more are dropped."""
DROP_LOG_S = 1.0
"""Least seconds between two errors about dropped records."""


class _Done:
    """Signals that one record (and those before it) reached the disk, or why not."""

    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: Exception | None = None


@dataclass(slots=True)
class _Item:
    """One entry of the writer's queue: a record to write (``kind`` set), a flush
    (``kind`` None, ``done`` set), and ``done`` set when its caller waits for the disk."""

    kind: RecordKind | None
    fields: dict
    done: _Done | None = None


_CLOSE = None
"""The queue's last entry: write what came before, then stop."""


class AuditWriter:
    """``append`` from any thread (never blocks on the disk); ``close`` writes what is queued."""

    def __init__(self, path: str | Path, max_queued: int = MAX_QUEUED, signer: HeadSigner | None = None,
                 head_interval_s: float = 60.0) -> None:
        """``signer``: signs the log's head when it opens, every ``head_interval_s`` while it moves, at close."""
        self.log = AuditLog(path, fsync=False)
        self.max_queued = max_queued
        self.signer, self.head_interval_s = signer, head_interval_s
        self._signed_at = time.monotonic()
        if signer is not None:
            self._sign(HeadState.OPEN)
        self.dropped = 0
        """Records dropped so far because the queue was full."""
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._count_lock = threading.Lock()
        self._queued = 0
        self._unreported = 0
        """Records dropped since the last ``records dropped`` record."""
        self._drop_logged = float("-inf")
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    @property
    def path(self) -> Path:
        return self.log.path

    def append(self, kind: RecordKind, fields: dict) -> None:
        """Queues one record (see :meth:`AuditLog.append`); drops it if :attr:`max_queued` records wait.
        ValueError (at once, not in the thread) if ``kind`` is not a :class:`RecordKind`."""
        _check_kind(kind)
        with self._count_lock:
            room = self._queued < self.max_queued
            self._queued += room
            tell = not room and self._drop()
        if room:
            self._queue.put(_Item(kind, dict(fields)))
        elif tell:
            log.error("audit queue full (%d records wait for the disk): %s record %s dropped (%d dropped so far)",
                      self.max_queued, kind, _what(fields), self.dropped)

    def _drop(self) -> bool:
        """Counts a dropped record (the count lock held); whether to log it (at most once a second)."""
        self.dropped += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._drop_logged < DROP_LOG_S:
            return False
        self._drop_logged = now
        return True

    def append_durable(self, kind: RecordKind, fields: dict, timeout_s: float = 10.0) -> None:
        """Writes one record and returns once it is on disk (for a deletion, which
        must not happen unrecorded); AuditError when it is not within ``timeout_s``
        (ValueError for a record the log refuses)."""
        _check_kind(kind)
        done = _Done()
        self._queue.put(_Item(kind, dict(fields), done))
        if not done.event.wait(timeout_s):
            raise AuditError(self.path, f"the {kind} record was not written within {timeout_s:.0f} s")
        if done.error is not None:
            raise done.error

    def sweep(self, expired: Callable[[dict], bool], cutoffs: Mapping[str, float] | None = None) -> SweepResult:
        """Retention (:meth:`AuditLog.sweep`), in order with the queued records' writes."""
        return self.log.sweep(expired, cutoffs)

    def _sign(self, state: HeadState) -> None:
        assert self.signer is not None
        self.signer.sign(state, self.log.seq, self.log.head, iso_time(time.time()))
        self._signed_at = time.monotonic()

    def _sign_due(self) -> None:
        """A ``running`` head, when the interval has passed and the head moved since the last one."""
        if self.signer is None or time.monotonic() < self._signed_at + self.head_interval_s:
            return
        if self.signer.signed != (self.log.seq, self.log.head):
            self._sign(HeadState.RUNNING)
        self._signed_at = time.monotonic()

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                self._sign_due()
                continue
            try:
                last = self._write_batch(batch)
            except Exception as exc:  # a bug here must not stop the writer: logged, the waiters told
                log.exception("audit writer: a batch failed")
                last = _release(batch, AuditError(self.path, f"the batch was not written: {exc!r}"))
            self._sign_due()
            if last:
                return

    def _take(self) -> list[_Item | None]:
        """The next batch (waiting for its first item; with a signer, at most until the next
        head is due: then maybe none); what it takes no longer counts as queued."""
        try:
            first = self._queue.get(timeout=None if self.signer is None else
                                    max(0.05, self._signed_at + self.head_interval_s - time.monotonic()))
        except queue.Empty:
            return []
        batch = [first]
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        taken = sum(1 for item in batch if item is not None and item.done is None)
        with self._count_lock:
            self._queued -= taken
        return batch

    def _write_batch(self, batch: list[_Item | None]) -> bool:
        """Writes the batch's records (then one for records dropped), syncs,
        tells the waiters; whether it held the closing signal."""
        waiting, last = [], False
        for item in batch:
            if item is None:
                last = True
                continue
            error = self._write(item.kind, item.fields) if item.kind is not None else None
            if item.done is not None:
                item.done.error = error
                waiting.append(item.done)
        self._report_dropped()
        error = self._sync()
        for done in waiting:
            done.error = done.error or error
            done.event.set()
        return last

    def _report_dropped(self) -> None:
        with self._count_lock:
            n, self._unreported = self._unreported, 0
        if n and self._write(RecordKind.RECOVERY, {"action": "records dropped", "count": n}) is not None:
            with self._count_lock:
                self._unreported += n  # in the next batch's record, then

    def _sync(self) -> Exception | None:
        try:
            self.log.sync()
        except AuditError as exc:
            log.error("audit records may not be on disk: %s", exc)
            return exc
        except Exception as exc:  # anything else: logged as well, the writer goes on
            log.exception("audit records may not be on disk (unexpected error)")
            return AuditError(self.path, f"cannot sync: {exc!r}")
        return None

    def _write(self, kind: RecordKind, fields: dict) -> Exception | None:
        """Writes one record; the error (logged) if it was not written."""
        try:
            self.log.append(kind, fields)
        except (AuditError, ValueError) as exc:
            log.error("audit record %s %s was not written: %s", kind, _what(fields), exc)
            return exc
        except Exception as exc:  # anything else: logged as well, the writer goes on
            log.exception("audit record %s %s was not written (unexpected error)", kind, _what(fields))
            return AuditError(self.path, f"the {kind} record was not written: {exc!r}")
        return None

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits (at most ``timeout_s``) until every record queued so far is on disk."""
        done = _Done()
        self._queue.put(_Item(None, {}, done))
        return done.event.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Writes what is queued, then closes the log."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout_s)
        self.log.close()
        if self.signer is not None and not self._thread.is_alive():  # nothing can follow the closing head
            self._sign(HeadState.CLOSED)


def _what(fields: dict) -> str:
    """The request or action a record describes, for a log line."""
    return str(fields.get("request_id") or fields.get("action") or fields.get("job") or "")


def _release(batch: list[_Item | None], error: Exception) -> bool:
    """Tells the batch's waiters not yet told that it failed; whether it held the closing signal."""
    last = False
    for item in batch:
        if item is None:
            last = True
        elif item.done is not None and not item.done.event.is_set():
            item.done.error = item.done.error or error
            item.done.event.set()
    return last


def _check_kind(kind: RecordKind) -> None:
    if not isinstance(kind, RecordKind):
        raise ValueError(f"audit record kind {kind!r} is not a RecordKind")
