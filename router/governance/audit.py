"""The router's audit log: append-only JSONL, one record per line, each line
chained to the one before it by SHA-256, so an edited, deleted or inserted
line is found by :func:`verify`.

A line is a JSON object: ``seq`` (1, 2, ...), ``time`` (ISO-8601 UTC,
milliseconds; never before the previous record's: a clock stepped back
writes the previous time again), ``kind`` (:class:`RecordKind`), ``prev``
(hex SHA-256 of the previous line's bytes without its newline; for seq 1
that of :data:`GENESIS_TEXT`), then the caller's fields. Request records
carry ``tenant``, operator records ``operator``; a record without
``tenant`` belongs to no tenant. :meth:`AuditLog.append` writes what it is
given and never looks inside: request records carry ``prompt``/``output``
text only when their tenant's ``log_prompts`` is true, and that is the
caller's rule.

Retention (:meth:`AuditLog.sweep`) replaces an expired record by a
tombstone ``{seq, time, kind, prev, tenant?, tombstone}`` whose
``tombstone`` is the hash of the line it replaces, so the next record's
``prev`` still matches. The same atomic rewrite (a temporary file, fsynced,
renamed over the log) ends with a ``retention`` record listing what was
removed and the cutoff applied per tenant, so tombstones never land without
it. :func:`verify` reports a tombstone no later retention record lists, one
dated after its retention record's cutoff for its tenant, and any record
dated before the one before it.

Beside the log ``<name>`` (all 0600):

- ``<name>.head``: "seq hash" of the last record known on disk, rewritten
  after each sync and on close. On open the log must still hold that
  record unchanged (AuditError otherwise: it was edited, or records were
  cut, while the router was down). Missing (a first start): nothing checked.
- ``<name>.torn-<unix time>``: the bytes of a last line cut short by a
  crash, moved aside on open; a ``recovery`` record ``{action: "torn tail
  moved", bytes, file}`` notes it in the chain. A complete line that does
  not fit the chain is never moved: the log is then refused (AuditError).
- ``.<name>.*.sweep``: a sweep's temporary file; one left by a crash may
  hold records past their retention and is deleted on open.

What the chain cannot show, there being no key: whoever can write the file
(and the folder) can

- append records at the tail that fit the chain: any record, or a
  tombstone of any record with a ``retention`` record covering it, whose
  cutoff must then be no earlier than that record's time (a cutoff that
  implies a retention shorter than the tenant's configured one is the
  sign: compare it with the retention record's own time);
- rewrite the whole tail from some record on (edit, drop or re-date the
  records after it and re-chain them, the side ``.head`` file too, or delete
  it): found only against a head noted elsewhere beforehand (``verify(path,
  head=...)``, ``kvrelay audit verify --head``), which the log must still
  contain;
- edit a tombstone's ``kind`` and ``tenant``, and its ``time`` within its
  neighbours' times and its retention record's cutoff (a tombstone's own
  line is not hashed).

An edit of the LAST record, or lines cut from the end, leave nothing after
them to disagree: the ``.head`` file finds those made while the log was
closed, a head noted elsewhere the rest."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.router.core.records import RecordKind
from kvrelay.router.governance.audit_chain import (
    GENESIS,
    GENESIS_TEXT,
    Broken,
    Checker,
    Line,
    VerifyResult,
    check_lines,
    link_of,
    listed_cutoffs,
    listed_ranges,
    owner_of,
    parse_line,
    parse_time,
    raw_lines,
    walk,
)

log = logging.getLogger(__name__)

RESERVED = frozenset({"seq", "time", "kind", "prev", "tombstone"})
"""Fields the log writes itself; a caller's record may not carry them."""
TAIL_CHUNK = 64 << 10
"""Bytes read at a time from the end of the file when reopening it."""
TAIL_LINES = 4096
"""Most lines checked back from the end on open (the record the ``.head`` file notes, if further, is read alone)."""
OTHER_TENANTS = "*"
"""Key of :meth:`AuditLog.sweep`'s ``cutoffs`` for a tenant it does not name (no tenant name can be "*")."""
_HASH = re.compile(r"[0-9a-f]{64}")


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
    """The ``retention`` record written (None: nothing expired, nothing written)."""


@dataclass(slots=True)
class _Plan:
    """What a sweep's rewrite found: its retention record's fields, gathered line by line."""

    result: SweepResult = field(default_factory=SweepResult)
    cutoffs: dict[str, datetime.datetime] = field(default_factory=dict)
    carried: list[list[int]] = field(default_factory=list)

    def fields(self, seqs: set[int]) -> dict:
        """The ``retention`` record: removed, counts, cutoffs (, carried)."""
        self.result.removed = _ranges(seqs)
        out = {"removed": [list(r) for r in self.result.removed], "counts": self.result.counts,
               "cutoffs": {k: _iso(v) for k, v in sorted(self.cutoffs.items())}}
        if self.carried:
            out["carried"] = self.carried
        return out

    def cut(self, owner: str, when: datetime.datetime) -> None:
        """Notes ``when`` as a cutoff of ``owner``'s records (the latest one wins)."""
        if owner not in self.cutoffs or when > self.cutoffs[owner]:
            self.cutoffs[owner] = when


def iso_time(t: float) -> str:
    """Unix time ``t`` as ISO-8601 UTC with milliseconds: ``2026-12-01T21:50:00.123Z``."""
    return _iso(datetime.datetime.fromtimestamp(t, datetime.UTC))


def _iso(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def dumps(record: dict) -> bytes:
    """A record's line (without newline): compact, keys in the order given, UTF-8; the bytes the chain hashes."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, sort_keys=False,
                      allow_nan=False).encode("utf-8")


def head_path(path: str | Path) -> Path:
    """The side file ``<name>.head`` that keeps the log's head while it is closed."""
    path = Path(path)
    return path.with_name(f"{path.name}.head")


def private_folder(folder: Path, name: str) -> None:
    """Creates ``folder`` (mode 0700) if missing. An existing one of this
    user's is made 0700 too when it is the log's own (it holds nothing but
    ``name``, its side files and its sweep files); a folder shared with
    other files (the cache folder, whose models workers of another user
    read) keeps its mode: the log itself is 0600 in any case."""
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)  # mkdir's mode is cut by the umask
        return
    info = folder.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) == 0o700:
        return
    if all(p.name == name or p.name.startswith((f".{name}.", f"{name}.")) for p in folder.iterdir()):
        os.chmod(folder, 0o700)


def _open_append(path: Path) -> int:
    fd = os.open(path, os.O_APPEND | os.O_CREAT | os.O_WRONLY, 0o600)
    os.fchmod(fd, 0o600)  # an existing file, or one the umask made
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(path: Path) -> None:
    """Deletes sweep files a crash left beside the log (they may hold records past their retention)."""
    try:
        for p in path.parent.iterdir():
            if p.name.startswith(f".{path.name}.") and p.name.endswith(".sweep"):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                log.warning("audit log %s: deleted %s, left by a sweep cut short", path, p.name)
    except OSError as exc:
        raise AuditError(path, f"cannot delete the sweep files a crash left: {exc.strerror or exc}") from exc


def _tail(fd: int, size: int, n: int = 2) -> list[bytes]:
    """The last ``n`` lines (fewer in a shorter file), without newlines; the file ends with one."""
    buf, pos = b"", size
    while pos > 0 and buf.count(b"\n") <= n:
        step = min(TAIL_CHUNK, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
    lines = buf[:-1].split(b"\n")
    return (lines[1:] if pos > 0 else lines)[-n:]


def _complete_end(fd: int, size: int) -> int:
    """Where the last complete line ends (after its newline); 0 if there is none."""
    pos = size
    while pos > 0:
        step = min(TAIL_CHUNK, pos)
        chunk = os.pread(fd, step, pos - step)
        at = chunk.rfind(b"\n")
        if at >= 0:
            return pos - step + at + 1
        pos -= step
    return 0


def _count_lines(fd: int, size: int) -> int:
    count, pos = 0, 0
    while pos < size:
        chunk = os.pread(fd, min(1 << 20, size - pos), pos)
        if not chunk:
            break
        count, pos = count + chunk.count(b"\n"), pos + len(chunk)
    return count


def _read_head(path: Path) -> tuple[int, str] | None:
    """(seq, hash) the side ``.head`` file notes; None if there is none (a warning if it is unreadable)."""
    side = head_path(path)
    try:
        parts = side.read_bytes().split()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("audit log %s: %s cannot be read (%s): its end is not checked", path, side.name, exc)
        return None
    if len(parts) != 2 or not parts[0].isdigit() or not _HASH.fullmatch(parts[1].decode("ascii", "replace")):
        log.warning("audit log %s: %s is not \"seq hash\": its end is not checked", path, side.name)
        return None
    return int(parts[0]), parts[1].decode("ascii")


def _resume(path: Path, f, end: int) -> tuple[int, str, float]:
    """(seq, head, Unix time) of the last record in the first ``end`` bytes
    of binary file ``f``; AuditError if that end is not a sound record, or
    is not what the ``.head`` file notes (records edited or cut while the log was closed)."""
    noted, fd = _read_head(path), f.fileno()
    if end == 0:
        _check_noted(path, [], noted, None)
        return 0, GENESIS, 0.0
    lines = _count_lines(fd, end)
    back = lines - noted[0] + 1 if noted is not None and 0 < noted[0] <= lines else 2
    tail = _tail(fd, end, min(max(2, back), TAIL_LINES))
    numbered = list(zip(range(lines - len(tail) + 1, lines + 1), tail))
    try:
        walked = list(walk(iter(numbered), anchored=numbered[0][0] > 1))
        when = parse_time(walked[-1].record["time"]).timestamp()
    except Broken as exc:
        raise AuditError(path, f"{exc.problem}; it cannot be continued ({_ADVICE})", exc.line) from None
    except ValueError:
        raise AuditError(path, f"line {lines}: its time is not an ISO-8601 time; it cannot be continued "
                               f"({_ADVICE})", lines) from None
    _check_noted(path, walked, noted, f if back > len(tail) else None)
    return walked[-1].record["seq"], walked[-1].link, when


def _line_at(f, no: int) -> Line | None:
    """Line ``no`` of binary file ``f`` (read from its start), or None if it is not a record."""
    f.seek(0)
    for n, raw in raw_lines(f):
        if n == no:
            try:
                record = parse_line(n, raw)
            except Broken:
                return None
            return Line(n, raw, record, link_of(raw, record))
    return None


def _check_noted(path: Path, walked: list[Line], noted: tuple[int, str] | None, f) -> None:
    """AuditError unless the record the ``.head`` file notes is in the log
    unchanged: among the last lines ``walked``, or (``f``) further back."""
    if noted is None or noted[0] == 0:
        return
    seq, want = noted
    last = walked[-1].record["seq"] if walked else 0
    name = head_path(path).name
    if seq > last:
        raise AuditError(path, f"records after seq {last} are missing: {name} notes seq {seq} as written "
                               f"({_ADVICE})", walked[-1].no if walked else None)
    line = next((w for w in walked if w.record["seq"] == seq), None)
    if line is None and f is not None:
        line = _line_at(f, seq)
    if line is None or line.record["seq"] != seq:
        raise AuditError(path, f"record seq {seq}, which {name} notes as written, is not at line {seq}: records "
                               f"before it were deleted or inserted ({_ADVICE})", seq)
    if line.link != want:
        raise AuditError(path, f"record seq {seq} (line {line.no}) is not the one this log wrote: its hash is "
                               f"{line.link}, {name} notes {want} (edited while the log was closed?) ({_ADVICE})",
                         line.no)


_ADVICE = "`kvrelay audit verify` reports the whole file; move it and its .head file aside to start a new log"


class AuditLog:
    """The open log: :meth:`append` from any thread, :meth:`sweep` for retention."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time, fsync: bool = True) -> None:
        """Opens (creating, mode 0600, in a 0700 folder) the log at ``path``
        and continues its chain. A last line cut short (a crash mid-write) is
        moved aside and noted by a ``recovery`` record; AuditError if the
        last complete line is not a sound record, or not the one the
        ``.head`` file notes: a broken chain is never continued.
        ``clock``: Unix time of each record. ``fsync``: each record on disk before append returns."""
        self.path = Path(path)
        self.clock = clock
        self.fsync = fsync
        self._lock = threading.Lock()
        self._sweeping = threading.Lock()
        self._seq, self._head, self._last_t = 0, GENESIS, 0.0
        self._noted: tuple[int, str] | None = None
        self._cut_to: int | None = None
        """Where a failed write's bytes that could not be cut off begin (cut before the next write)."""
        self._fd: int | None = None
        try:
            private_folder(self.path.parent, self.path.name)
            _remove_stale(self.path)
            self._fd = _open_append(self.path)
            self._open()
        except OSError as exc:
            self._close_fd()
            raise AuditError(self.path, f"cannot open: {exc.strerror or exc}") from exc
        except BaseException:
            self._close_fd()
            raise

    def _open(self) -> None:
        """Resumes the chain; a torn last line is moved aside (after the rest is found sound) and noted."""
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            end = _complete_end(f.fileno(), size)
            self._seq, self._head, self._last_t = _resume(self.path, f, end)
            torn = os.pread(f.fileno(), size - end, end) if end < size else None
        if torn is not None:
            n, name = self._move_torn(end, torn)
            try:
                self.append(RecordKind.RECOVERY, {"action": "torn tail moved", "bytes": n, "file": name})
                self.sync()
            except AuditError as exc:  # the log is sound: it opens all the same, the torn file stays
                log.error("the torn tail moved to %s is not recorded in the chain: %s", name, exc)

    def _move_torn(self, end: int, data: bytes) -> tuple[int, str]:
        """Moves ``data``, the bytes after ``end`` (a line without its newline), to
        ``<name>.torn-<unix time>`` and cuts the log there; (bytes, file name)."""
        base = f"{self.path.name}.torn-{int(self.clock())}"
        name, i = base, 0
        while True:
            try:
                fd = os.open(self.path.parent / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:
                i += 1
                name = f"{base}-{i}"
        try:
            os.fchmod(fd, 0o600)
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = self._open_fd()
        os.ftruncate(fd, end)
        os.fsync(fd)
        _fsync_folder(self.path.parent)
        log.warning("audit log %s: its last line was cut short (%d bytes, a crash mid-write?); moved to %s",
                    self.path, len(data), name)
        return len(data), name

    @property
    def seq(self) -> int:
        """Seq of the last record (0: none yet)."""
        return self._seq

    @property
    def head(self) -> str:
        """Hash of the last record: what an operator notes to check the log's end later (``verify(head=)``)."""
        return self._head

    def close(self) -> None:
        """Syncs, notes the head in the ``.head`` file, closes. A sync that
        fails is logged (the head is then not noted)."""
        with self._lock:
            if self._fd is None:
                return
            try:
                self._sync_locked()
            except AuditError as exc:
                log.error("%s", exc)
            self._close_fd()

    def _open_fd(self) -> int:
        """The log's file descriptor; AuditError if the log is closed."""
        if self._fd is None:
            raise AuditError(self.path, "the log is closed")
        return self._fd

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def append_durable(self, kind: RecordKind, fields: dict, timeout_s: float = 10.0) -> dict:
        """:meth:`append`, on disk when it returns (fsync whatever ``fsync`` says)."""
        record = self.append(kind, fields)
        self.sync()
        return record

    def sync(self) -> None:
        """Every record written so far on disk (for a log opened with
        ``fsync=False``, after a batch), and noted in the ``.head`` file. AuditError if it cannot be."""
        with self._lock:
            if self._fd is not None:
                self._sync_locked()

    def _sync_locked(self) -> None:
        fd = self._open_fd()
        try:
            os.fsync(fd)
        except OSError as exc:
            raise AuditError(self.path, f"cannot sync: {exc.strerror or exc}") from exc
        self._note_head()

    def _note_head(self) -> None:
        """Writes "seq hash" to the ``.head`` file (renamed into place; not
        fsynced: after a power cut it may be older than the log, never newer). A failure is logged."""
        if self._noted == (self._seq, self._head):
            return
        side = head_path(self.path)
        tmp = side.with_name(f".{side.name}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                _write_all(fd, f"{self._seq} {self._head}\n".encode())
            finally:
                os.close(fd)
            os.replace(tmp, side)
        except OSError as exc:
            log.warning("audit log %s: cannot write %s (%s): its end is not checked on the next start",
                        self.path, side.name, exc.strerror or exc)
            return
        self._noted = (self._seq, self._head)

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def append(self, kind: RecordKind, fields: dict) -> dict:
        """Writes one record (``kind`` and ``fields`` after seq, time, kind,
        prev) as one line; returns it. Thread-safe. ValueError if ``kind`` is
        not a :class:`RecordKind` (a record no ``--kind`` query could find),
        ``fields`` holds a reserved name or a value JSON cannot hold; AuditError
        if the write fails, whatever the reason (the file is left as it was)."""
        if not isinstance(kind, RecordKind):
            raise ValueError(f"audit record kind {kind!r} is not a RecordKind")
        clash = RESERVED & fields.keys()
        if clash:
            raise ValueError(f"audit record fields {sorted(clash)} are written by the log itself")
        with self._lock:
            return self._append_locked(kind, fields)

    def _next(self, kind: RecordKind, fields: dict) -> tuple[dict, bytes, float]:
        """The next record, its line and its Unix time (never before the last record's)."""
        t = max(self.clock(), self._last_t)
        record = {"seq": self._seq + 1, "time": iso_time(t), "kind": kind.value, "prev": self._head, **fields}
        try:
            raw = dumps(record)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"audit record {kind!r} is not JSON: {exc}") from None
        return record, raw, t

    def _append_locked(self, kind: RecordKind, fields: dict) -> dict:
        record, raw, t = self._next(kind, fields)
        self._write(raw + b"\n")
        self._seq, self._head, self._last_t = record["seq"], hashlib.sha256(raw).hexdigest(), t
        if self.fsync:
            self._note_head()
        return record

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            raise AuditError(self.path, "closed: no record can be written")
        start = None
        try:
            self._cut_failed()
            start = os.fstat(self._fd).st_size
            _write_all(self._fd, data)
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            if start is not None:
                self._cut_back(start)
            raise AuditError(self.path, f"cannot write a record: {exc.strerror or exc}") from exc

    def _cut_back(self, start: int) -> None:
        """Cuts a failed write off (no half line for the next record to follow); if it cannot, the next write will."""
        try:
            os.ftruncate(self._open_fd(), start)
            self._cut_to = None
        except OSError:
            self._cut_to = start

    def _cut_failed(self) -> None:
        if self._cut_to is not None:
            os.ftruncate(self._open_fd(), self._cut_to)
            self._cut_to = None

    def sweep(self, expired: Callable[[dict], bool], cutoffs: Mapping[str, float] | None = None) -> SweepResult:
        """Replaces each record (not yet a tombstone) for which ``expired``
        is true by its tombstone, and writes a ``retention`` record
        ``{removed: [[first, last], ...], counts: {tenant: n}, cutoffs:
        {tenant: ISO time}}`` (``carried``: the ranges of retention records
        it removed, whose cutoffs its own take in), all in one atomic,
        durable rewrite (a 0600 file beside the log, fsynced, renamed over
        it, the folder fsynced). Appends wait only for the final copy and rename.

        ``cutoffs``: the Unix time before which ``expired`` removes records,
        per tenant ("": records of no tenant; :data:`OTHER_TENANTS`: a tenant
        not named, or ""). Then a record is removed only if it is also
        older than its cutoff, and the scan stops at the first record younger
        than every cutoff (records are in time order). None: every record is
        scanned, and a tenant's cutoff is the time of its youngest record removed.

        Nothing expired: nothing written. AuditError if the log does not
        verify (it is left as it is) or cannot be rewritten; ValueError if
        a cutoff is not a Unix time."""
        limits = None if cutoffs is None else {k: _cutoff_time(k, v) for k, v in cutoffs.items()}
        with self._sweeping:
            try:
                with self._lock:
                    if self._fd is None:
                        raise AuditError(self.path, "closed: not swept")
                    size = os.fstat(self._fd).st_size
                seqs = self._scan(expired, limits, size)
                return self._apply(seqs, limits, size) if seqs else SweepResult()
            except OSError as exc:
                raise AuditError(self.path, f"cannot sweep: {exc.strerror or exc}; not swept") from exc

    def _scan(self, expired: Callable[[dict], bool], limits: dict[str, datetime.datetime] | None,
              size: int) -> set[int]:
        """The seqs of the records to remove among the first ``size`` bytes,
        read (and checked) only up to the first record younger than every cutoff."""
        latest = max(limits.values(), default=None) if limits is not None else None
        if limits is not None and latest is None:
            return set()
        seqs, checker = set(), Checker()
        with open(self.path, "rb") as f:
            try:
                for line in walk(raw_lines(f, size)):
                    when = checker.feed(line)
                    if latest is not None and when > latest:
                        break
                    if "tombstone" not in line.record and _due(line.record, when, expired, limits):
                        seqs.add(line.record["seq"])
            except Broken as exc:
                raise AuditError(self.path, f"{exc.problem}; not swept", exc.line) from None
        return seqs

    def _apply(self, seqs: set[int], limits: dict[str, datetime.datetime] | None, size: int) -> SweepResult:
        """Rewrites the log with ``seqs`` tombstoned and the retention record at its end."""
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".sweep")
        try:
            with open(fd, "wb") as out:
                plan = self._rewrite(out, seqs, limits, size)
            fields = plan.fields(seqs)
            with self._lock:
                plan.result.record = self._commit(tmp, size, fields)
            return plan.result
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _rewrite(self, out, seqs: set[int], limits: dict[str, datetime.datetime] | None, size: int) -> _Plan:
        """The first ``size`` bytes copied to ``out`` with ``seqs``
        tombstoned, the whole checked on the way (AuditError: not swept)."""
        plan, checker = _Plan(), Checker()
        with open(self.path, "rb") as f:
            try:
                for line in walk(raw_lines(f, size)):
                    when = checker.feed(line)
                    if line.record["seq"] not in seqs:
                        out.write(line.raw + b"\n")
                        continue
                    out.write(dumps(_tombstone(line.record, line.raw)) + b"\n")
                    _note_removed(plan, line, when, limits)
            except Broken as exc:
                raise AuditError(self.path, f"{exc.problem}; not swept", exc.line) from None
        verdict = checker.result()
        if not verdict.ok:
            raise AuditError(self.path, f"{verdict.problem}; not swept", verdict.line)
        return plan

    def _commit(self, tmp: str, size: int, fields: dict) -> dict:
        """With the append lock held: copies records appended since ``size``
        to ``tmp``, ends it with the retention record, fsyncs it, puts it in
        the log's place, and appends from now on to it; the record."""
        record, raw, t = self._next(RecordKind.RETENTION, fields)
        self._cut_failed()
        with open(tmp, "ab") as out, open(self.path, "rb") as f:
            f.seek(size)
            shutil.copyfileobj(f, out, 1 << 20)
            out.write(raw + b"\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        self._seq, self._head, self._last_t = record["seq"], hashlib.sha256(raw).hexdigest(), t
        self._close_fd()  # from now on "closed" rather than writing to the old file, should reopening fail
        self._fd = _open_append(self.path)
        _fsync_folder(self.path.parent)
        self._note_head()
        return record


def _cutoff_time(owner: str, value: float) -> datetime.datetime:
    """A sweep cutoff as the time a record must not be after (to the millisecond, as times are written)."""
    try:
        return parse_time(iso_time(float(value)))
    except (TypeError, ValueError, OverflowError, OSError):
        raise ValueError(f"sweep cutoff for {owner!r} is not a Unix time: {value!r}") from None


def _cutoff_of(record: dict, limits: dict[str, datetime.datetime]) -> datetime.datetime | None:
    """The cutoff that applies to ``record`` (None: none, it is kept)."""
    if "tenant" not in record:
        return limits.get("")
    tenant = str(record["tenant"])
    named = limits.get(tenant) if tenant not in ("", OTHER_TENANTS) else None
    return named if named is not None else limits.get(OTHER_TENANTS)


def _due(record: dict, when: datetime.datetime, expired: Callable[[dict], bool],
         limits: dict[str, datetime.datetime] | None) -> bool:
    """Whether the sweep removes ``record`` (dated ``when``)."""
    if limits is not None:
        cut = _cutoff_of(record, limits)
        if cut is None or when > cut:
            return False
    return bool(expired(record))


def _note_removed(plan: _Plan, line: Line, when: datetime.datetime,
                  limits: dict[str, datetime.datetime] | None) -> None:
    """Counts a removed record in ``plan``: its tenant's count and cutoff, what a retention record carried."""
    record, counts = line.record, plan.result.counts
    owner = owner_of(record)
    counts[owner] = counts.get(owner, 0) + 1
    cut = _cutoff_of(record, limits) if limits is not None else when
    if cut is None:  # _due removes a record only under a cutoff
        raise RuntimeError(f"audit record seq {record['seq']} was removed under no cutoff")
    plan.cut(owner, cut)
    if record["kind"] == RecordKind.RETENTION:
        plan.carried += [list(r) for r in listed_ranges(line)]
        for key, (cut, _) in listed_cutoffs(line).items():
            plan.cut(key, cut)


def _tombstone(record: dict, raw: bytes) -> dict:
    stone = {k: record[k] for k in ("seq", "time", "kind", "prev")}
    if "tenant" in record:
        stone["tenant"] = record["tenant"]
    stone["tombstone"] = hashlib.sha256(raw).hexdigest()
    return stone


def _ranges(seqs: set[int] | list[int]) -> list[tuple[int, int]]:
    """Sorted seqs as runs of consecutive ones: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    out: list[tuple[int, int]] = []
    for s in sorted(seqs):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def verify(path: str | Path, head: str | None = None) -> VerifyResult:
    """Walks the log at ``path`` and reports its first problem: a line
    that is not a record, a gap in seq (records deleted), a record out of
    place (inserted), a ``prev`` that does not match (the record before it
    edited), a record dated before the one before it, a tombstone no later
    retention record lists or one dated after its retention record's cutoff.
    ``head``: a hash noted earlier (:attr:`AuditLog.head`); the log must
    still contain it, which finds the last records edited or cut off since.
    OSError if the file cannot be read."""
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


__all__ = [
    "GENESIS",
    "GENESIS_TEXT",
    "OTHER_TENANTS",
    "AuditError",
    "AuditLog",
    "RecordKind",
    "SweepResult",
    "VerifyResult",
    "head_path",
    "iso_time",
    "link_of",
    "parse_time",
    "query",
    "verify",
]
