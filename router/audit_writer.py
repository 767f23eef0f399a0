"""The router's audit records written from a thread of their own: callers on
the event loop only queue a record, and the thread writes them in order in
batches, each batch made durable with one fsync (group commit). A record
costs the loop a queue put instead of a ~4 ms fsync (measured on this
machine's disk, benchmarks/RESULTS.md).

A record that cannot be written (disk full, a closed log) is logged as an
error with its kind and the request or action it describes; serving goes
on (the audit log is evidence, not a gate)."""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

from router.audit import AuditError, AuditLog, SweepResult

log = logging.getLogger(__name__)

MAX_BATCH = 512
"""Most records written before one fsync."""


class _Done:
    """Signals that one record (and those before it) reached the disk, or why not."""

    __slots__ = ("event", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: Exception | None = None


class AuditWriter:
    """``append`` from any thread (never blocks on the disk); ``close`` writes what is queued."""

    def __init__(self, path: str | Path) -> None:
        self.log = AuditLog(path, fsync=False)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    @property
    def path(self) -> Path:
        return self.log.path

    def append(self, kind: str, fields: dict) -> None:
        """Queues one record (see :meth:`AuditLog.append`)."""
        self._queue.put((str(kind), dict(fields), None))

    def append_durable(self, kind: str, fields: dict, timeout_s: float = 10.0) -> None:
        """Writes one record and returns once it is on disk (for a deletion, which
        must not happen unrecorded); AuditError when it is not within ``timeout_s``."""
        done = _Done()
        self._queue.put((str(kind), dict(fields), done))
        if not done.event.wait(timeout_s):
            raise AuditError(self.path, f"the {kind} record was not written within {timeout_s:.0f} s")
        if done.error is not None:
            raise done.error

    def sweep(self, expired) -> SweepResult:
        """Retention (:meth:`AuditLog.sweep`), in order with the queued records' writes."""
        return self.log.sweep(expired)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            waiting, last = [], False
            for item in batch:
                if item is None:
                    last = True
                    continue
                kind, fields, done = item
                if done is not None:
                    waiting.append(done)
                if kind:
                    done_error = self._write(kind, fields)
                    if done is not None:
                        done.error = done_error
            try:
                self.log.sync()
            except AuditError as exc:
                log.error("audit records may not be on disk: %s", exc)
                for done in waiting:
                    done.error = done.error or exc
            for done in waiting:
                done.event.set()
            if last:
                return

    def _write(self, kind: str, fields: dict) -> Exception | None:
        try:
            self.log.append(kind, fields)
        except (AuditError, ValueError) as exc:
            what = fields.get("request_id") or fields.get("action") or fields.get("job") or ""
            log.error("audit record %s %s was not written: %s", kind, what, exc)
            return exc
        return None

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits (at most ``timeout_s``) until every record queued so far is on disk."""
        done = _Done()
        self._queue.put(("", {}, done))
        return done.event.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Writes what is queued, then closes the log."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self.log.close()
