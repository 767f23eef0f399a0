"""The router's audit log: append-only JSONL, one record per line, each line
chained to the one before it by SHA-256, so an edited, deleted or inserted
line is found by :func:`verify`.

A line is a JSON object: ``seq`` (1, 2, ...), ``time`` (ISO-8601 UTC,
milliseconds), ``kind`` (:class:`RecordKind`), ``prev`` (hex SHA-256 of the
previous line's bytes without its newline; for seq 1 that of
:data:`GENESIS_TEXT`), then the caller's fields. Request records carry
``tenant``, operator records ``operator``; a record without ``tenant``
belongs to no tenant. :meth:`AuditLog.append` writes what it is given and
never looks inside: request records carry ``prompt``/``output`` text only
when their tenant's ``log_prompts`` is true, and that is the caller's rule.

Retention (:meth:`AuditLog.sweep`) replaces an expired record by a
tombstone ``{seq, time, kind, prev, tenant?, tombstone}`` whose
``tombstone`` is the hash of the line it replaces, so the next record's
``prev`` still matches; a ``retention`` record appended after it lists what
was removed, and a tombstone that no later retention record lists is
reported as a deletion.

What the chain cannot show by itself: an edit of the LAST record, or lines
cut from the end, leave nothing after them to disagree. ``verify(path,
head=...)`` closes that gap for whoever noted the head (the hash
:func:`verify` and ``kvrelay audit verify`` print) at some earlier time:
the log must still contain it. Someone able to rewrite the whole file can
also rewrite the whole chain; a head kept elsewhere is what detects that."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from router.audit_chain import (
    GENESIS,
    GENESIS_TEXT,
    Broken,
    VerifyResult,
    check_lines,
    link_of,
    raw_lines,
    walk,
)

RESERVED = frozenset({"seq", "time", "kind", "prev", "tombstone"})
"""Fields the log writes itself; a caller's record may not carry them."""
TAIL_CHUNK = 64 << 10
"""Bytes read at a time from the end of the file when reopening it."""


class RecordKind(StrEnum):
    """What a record is about (the ``kind`` field)."""

    REQUEST = "request"
    OPERATOR = "operator"
    REGISTRATION = "registration"
    JOB = "job"
    RETENTION = "retention"


class AuditError(Exception):
    """The audit log cannot be opened, written or swept; the message names the file (and line)."""

    def __init__(self, path: str | Path, message: str, line: int | None = None) -> None:
        super().__init__(f"audit log {path}: {message}")
        self.path = str(path)
        self.line = line


@dataclass(slots=True)
class SweepResult:
    """What one :meth:`AuditLog.sweep` replaced by tombstones."""

    removed: list[tuple[int, int]] = field(default_factory=list)
    """Seq ranges (first, last) tombstoned by this sweep."""
    counts: dict[str, int] = field(default_factory=dict)
    """Records tombstoned per tenant ("": records of no tenant)."""
    record: dict | None = None
    """The ``retention`` record appended (None: nothing expired, nothing written)."""


def iso_time(t: float) -> str:
    """Unix time ``t`` as ISO-8601 UTC with milliseconds: ``2026-12-01T21:50:00.123Z``."""
    when = datetime.datetime.fromtimestamp(t, datetime.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: str) -> datetime.datetime:
    """A record's ``time`` (or any ISO-8601 time; naive = UTC) as an aware datetime; ValueError if not one."""
    when = datetime.datetime.fromisoformat(text)
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)


def dumps(record: dict) -> bytes:
    """A record's line (without newline): compact, keys in the order given, UTF-8; the bytes the chain hashes."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, sort_keys=False,
                      allow_nan=False).encode("utf-8")


def private_folder(folder: Path, name: str) -> None:
    """Creates ``folder`` (mode 0700) if missing. An existing one of this
    user's is made 0700 too when it is the log's own (it holds nothing but
    ``name`` and its sweep files); a folder shared with other files (the
    cache folder, whose models workers of another user read) keeps its mode:
    the log itself is 0600 in any case."""
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)  # mkdir's mode is cut by the umask
        return
    info = folder.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) == 0o700:
        return
    if all(p.name == name or p.name.startswith(f".{name}.") for p in folder.iterdir()):
        os.chmod(folder, 0o700)


def _open_append(path: Path) -> int:
    fd = os.open(path, os.O_APPEND | os.O_CREAT | os.O_WRONLY, 0o600)
    os.fchmod(fd, 0o600)  # an existing file, or one the umask made
    return fd


def _tail(fd: int, size: int, n: int = 2) -> list[bytes]:
    """The last ``n`` lines (fewer in a shorter file), without newlines; the file ends with one."""
    buf, pos = b"", size
    while pos > 0 and buf.count(b"\n") <= n:
        step = min(TAIL_CHUNK, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
    lines = buf[:-1].split(b"\n")
    return (lines[1:] if pos > 0 else lines)[-n:]


def _count_lines(fd: int, size: int) -> int:
    count, pos = 0, 0
    while pos < size:
        chunk = os.pread(fd, 1 << 20, pos)
        if not chunk:
            break
        count, pos = count + chunk.count(b"\n"), pos + len(chunk)
    return count


def _resume(path: Path) -> tuple[int, str]:
    """(seq, head) of an existing log's last record; AuditError if its end is not a sound record."""
    with open(path, "rb") as f:
        return _resume_fd(path, f.fileno())


def _resume_fd(path: Path, fd: int) -> tuple[int, str]:
    size = os.fstat(fd).st_size
    if size == 0:
        return 0, GENESIS
    lines = _count_lines(fd, size)
    if os.pread(fd, 1, size - 1) != b"\n":
        raise AuditError(path, f"line {lines + 1} is incomplete (no newline at its end: a write cut short?); "
                               f"it cannot be continued ({_ADVICE})", lines + 1)
    tail = _tail(fd, size)
    numbered = list(zip(range(lines - len(tail) + 1, lines + 1), tail))
    try:
        last = list(walk(iter(numbered), anchored=lines > 1))[-1]
    except Broken as exc:
        raise AuditError(path, f"{exc.problem}; it cannot be continued ({_ADVICE})", exc.line) from None
    return last.record["seq"], last.link


_ADVICE = "`kvrelay audit verify` reports the whole file; move it aside to start a new log"


class AuditLog:
    """The open log: :meth:`append` from any thread, :meth:`sweep` for retention."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time, fsync: bool = True) -> None:
        """Opens (creating, mode 0600, in a 0700 folder) the log at ``path``
        and continues its chain; AuditError if its last line is not a sound
        record (a half-written line after a crash): a broken chain is never continued.
        ``clock``: Unix time of each record. ``fsync``: each record on disk before append returns."""
        self.path = Path(path)
        self.clock = clock
        self.fsync = fsync
        self._lock = threading.Lock()
        self._sweeping = threading.Lock()
        private_folder(self.path.parent, self.path.name)
        self._fd: int | None = _open_append(self.path)
        try:
            self._seq, self._head = _resume(self.path)
        except BaseException:
            self.close()
            raise

    @property
    def seq(self) -> int:
        """Seq of the last record (0: none yet)."""
        return self._seq

    @property
    def head(self) -> str:
        """Hash of the last record: what an operator notes to check the log's end later (``verify(head=)``)."""
        return self._head

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def append_durable(self, kind: str, fields: dict, timeout_s: float = 10.0) -> dict:
        """:meth:`append`, on disk when it returns (fsync whatever ``fsync`` says)."""
        record = self.append(kind, fields)
        self.sync()
        return record

    def sync(self) -> None:
        """Every record written so far on disk (for a log opened with ``fsync=False``, after a batch)."""
        with self._lock:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                except OSError as exc:
                    raise AuditError(self.path, f"cannot sync: {exc.strerror or exc}") from exc

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def append(self, kind: str, fields: dict) -> dict:
        """Writes one record (``kind`` and ``fields`` after seq, time, kind,
        prev) as one line; returns it. Thread-safe. ValueError if ``fields``
        holds a reserved name or a value JSON cannot hold; AuditError if the
        write fails (the file is left as it was)."""
        clash = RESERVED & fields.keys()
        if clash:
            raise ValueError(f"audit record fields {sorted(clash)} are written by the log itself")
        with self._lock:
            return self._append_locked(kind, fields)

    def _append_locked(self, kind: str, fields: dict) -> dict:
        record = {"seq": self._seq + 1, "time": iso_time(self.clock()), "kind": str(kind), "prev": self._head,
                  **fields}
        try:
            raw = dumps(record)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"audit record {kind!r} is not JSON: {exc}") from None
        self._write(raw + b"\n")
        self._seq, self._head = record["seq"], hashlib.sha256(raw).hexdigest()
        return record

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            raise AuditError(self.path, "closed")
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)  # no half line for the next record to follow
            raise AuditError(self.path, f"cannot write a record: {exc.strerror or exc}") from exc

    def sweep(self, expired: Callable[[dict], bool]) -> SweepResult:
        """Replaces each record (not yet a tombstone) for which ``expired``
        is true by its tombstone, rewriting the file atomically (a 0600 file
        beside it, fsynced, then renamed over it), and appends a
        ``retention`` record ``{removed: [[first, last], ...], counts:
        {tenant: n}}`` (``carried``: the ranges of retention records it
        removed). Nothing expired: nothing written. Appends wait only for
        the final copy and rename. AuditError if the log does not verify (it
        is left as it is)."""
        with self._sweeping:
            with self._lock:
                size = os.fstat(self._fd).st_size if self._fd is not None else 0
            _verify_prefix(self.path, size)
            tmp, result, carried = self._rewrite(expired, size)
            if tmp is None:
                return result
            try:
                with self._lock:
                    self._replace(tmp, size)
                    fields = {"removed": [list(r) for r in result.removed], "counts": result.counts}
                    if carried:
                        fields["carried"] = carried
                    result.record = self._append_locked(RecordKind.RETENTION, fields)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            return result

    def _rewrite(self, expired: Callable[[dict], bool], size: int) -> tuple[str | None, SweepResult, list]:
        """The first ``size`` bytes written to a temporary file with expired
        records tombstoned: (its path or None if nothing expired, what was removed, ranges carried)."""
        result, seqs, carried = SweepResult(), [], []
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".sweep")
        try:
            with open(fd, "wb") as out, open(self.path, "rb") as f:
                for _, raw in raw_lines(f, size):
                    record = json.loads(raw)
                    if "tombstone" in record or not expired(record):
                        out.write(raw + b"\n")
                        continue
                    out.write(dumps(_tombstone(record, raw)) + b"\n")
                    seqs.append(record["seq"])
                    owner = str(record["tenant"]) if "tenant" in record else ""
                    result.counts[owner] = result.counts.get(owner, 0) + 1
                    if record["kind"] == RecordKind.RETENTION:
                        carried += record.get("removed", []) + record.get("carried", [])
        except BaseException:
            os.unlink(tmp)
            raise
        if not seqs:
            os.unlink(tmp)
            return None, result, carried
        result.removed = _ranges(seqs)
        return tmp, result, carried

    def _replace(self, tmp: str, size: int) -> None:
        """With the append lock held: copies records appended since ``size``
        to ``tmp``, puts it in the log's place, and appends from now on to it."""
        with open(tmp, "ab") as out, open(self.path, "rb") as f:
            f.seek(size)
            while chunk := f.read(1 << 20):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
        old, self._fd = self._fd, _open_append(self.path)
        if old is not None:
            os.close(old)


def _tombstone(record: dict, raw: bytes) -> dict:
    stone = {k: record[k] for k in ("seq", "time", "kind", "prev")}
    if "tenant" in record:
        stone["tenant"] = record["tenant"]
    stone["tombstone"] = hashlib.sha256(raw).hexdigest()
    return stone


def _ranges(seqs: list[int]) -> list[tuple[int, int]]:
    """Sorted seqs as runs of consecutive ones: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    out: list[tuple[int, int]] = []
    for s in sorted(seqs):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _verify_prefix(path: Path, size: int) -> None:
    with open(path, "rb") as f:
        result = check_lines(raw_lines(f, size))
    if not result.ok:
        raise AuditError(path, f"{result.problem}; not swept", result.line)


def verify(path: str | Path, head: str | None = None) -> VerifyResult:
    """Walks the log at ``path`` and reports its first problem: a line
    that is not a record, a gap in seq (records deleted), a record out of
    place (inserted), a ``prev`` that does not match (the record before it
    edited), a tombstone no later retention record lists. ``head``: a hash
    noted earlier (:attr:`AuditLog.head`); the log must still contain it,
    which finds the last records edited or cut off since. OSError if the
    file cannot be read."""
    with open(path, "rb") as f:
        return check_lines(raw_lines(f), head)


def query(path: str | Path, tenant: str | None = None, site: str | None = None,
          since: datetime.datetime | None = None, kind: str | None = None) -> Iterator[dict]:
    """The records (never tombstones) of the log at ``path`` that match
    every filter given: ``tenant``; ``site`` (any of ``prefill_site``,
    ``decode_site``, ``site``); ``since`` (time at or after it; naive =
    UTC); ``kind``. Lines that do not parse are skipped (:func:`verify`
    reports them)."""
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=datetime.UTC)
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict) and "tombstone" not in record and _matches(record, tenant, site, since,
                                                                                   kind):
                yield record


def _matches(record: dict, tenant: str | None, site: str | None, since: datetime.datetime | None,
             kind: str | None) -> bool:
    if tenant is not None and record.get("tenant") != tenant:
        return False
    if kind is not None and record.get("kind") != kind:
        return False
    if site is not None and site not in (record.get("prefill_site"), record.get("decode_site"), record.get("site")):
        return False
    if since is not None:
        try:
            return parse_time(str(record.get("time"))) >= since
        except ValueError:
            return False
    return True


__all__ = ["AuditError", "AuditLog", "GENESIS", "GENESIS_TEXT", "RecordKind", "SweepResult", "VerifyResult",
           "iso_time", "link_of", "parse_time", "query", "verify"]
