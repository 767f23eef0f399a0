"""Checking an audit log's hash chain (router/audit.py writes it): each
line in order against the one before it, and every tombstone against the
retention records after it. Pure: lines in, a :class:`VerifyResult` out.

How a problem is named, at the first line that does not fit:

- not JSON, or not a record: "line N is not a JSON record";
- seq jumps ahead: "record(s) seq a..b deleted before line N";
- a line that fits neither before nor after its neighbours, or a seq that
  repeats or goes back: "a record was inserted at line N (seq s)" (a line
  forged to fit after the previous one is found by the next one, which then
  links past it);
- seq continues but ``prev`` is not the previous line's hash: "record seq
  K (line N-1) was edited";
- a tombstone that no later ``retention`` record lists: "record seq K
  (line N) was deleted without a retention record";
- a ``head`` noted earlier that the log no longer contains: its end was
  edited or cut off.

The last record's own edit leaves nothing after it to disagree: only the
next append's ``prev`` (or a noted head) shows it."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

GENESIS_TEXT = b"kvrelay audit log v1"
GENESIS = hashlib.sha256(GENESIS_TEXT).hexdigest()
"""``prev`` of the first record: the hex SHA-256 of :data:`GENESIS_TEXT`."""
_HASH = re.compile(r"[0-9a-f]{64}")


@dataclass(slots=True)
class VerifyResult:
    """What a check found: ``ok``, or the first problem, its line and seq."""

    ok: bool
    records: int
    """Lines read and found in order (all of them when ``ok``)."""
    head: str
    """Hex hash the next record's ``prev`` must be: that of the last good line."""
    problem: str | None = None
    line: int | None = None
    seq: int | None = None


class Broken(Exception):
    """The chain breaks here: ``problem`` names the line (and seq when known)."""

    def __init__(self, problem: str, line: int | None, seq: int | None) -> None:
        super().__init__(problem)
        self.problem, self.line, self.seq = problem, line, seq


@dataclass(slots=True)
class Line:
    no: int
    raw: bytes
    record: dict
    link: str
    """What the next record's ``prev`` must be: the line's hash, or for a tombstone the hash it carries."""


def raw_lines(f, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes without the newline) of binary file ``f``, up to
    ``limit`` bytes (a line boundary); Broken at a last line with no newline."""
    pos = 0
    for no, raw in enumerate(f, 1):
        if limit is not None and pos >= limit:
            return
        pos += len(raw)
        if not raw.endswith(b"\n"):
            raise Broken(f"line {no} is incomplete (no newline at its end: a write cut short?)", no, None)
        yield no, raw[:-1]


def link_of(raw: bytes, record: dict) -> str:
    """What the record after this line must have as ``prev``."""
    return record["tombstone"] if "tombstone" in record else hashlib.sha256(raw).hexdigest()


def parse_line(no: int, raw: bytes, expect: int | None = None) -> dict:
    """Line ``no`` as a record; Broken if it is not one (``expect``: the seq it should have, for the message)."""
    where = f" (where seq {expect} was expected)" if expect is not None else ""
    try:
        record = json.loads(raw)
    except ValueError:
        raise Broken(f"line {no} is not a JSON record{where}", no, expect) from None
    if not isinstance(record, dict):
        raise Broken(f"line {no} is not a JSON record{where}", no, expect)
    seq = record.get("seq")
    if (type(seq) is not int or seq < 1 or not all(isinstance(record.get(k), str) for k in ("time", "kind", "prev"))
            or ("tombstone" in record and not _HASH.fullmatch(str(record["tombstone"])))):
        raise Broken(f"line {no} is not an audit record (seq, time, kind and prev are required){where}", no, expect)
    return record


class _Peek:
    """An iterator that can look one item ahead."""

    def __init__(self, it: Iterator) -> None:
        self._it, self._next, self._has = it, None, False

    def __iter__(self) -> _Peek:
        return self

    def __next__(self):
        if self._has:
            self._has = False
            return self._next
        return next(self._it)

    def peek(self):
        if not self._has:
            self._next, self._has = next(self._it, None), True
        return self._next


def walk(lines: Iterator[tuple[int, bytes]], anchored: bool = False) -> Iterator[Line]:
    """Each line as a :class:`Line`, checked against the one before it;
    Broken at the first that does not fit. ``anchored``: the first line is
    taken as it is (the tail of a longer file), the rest checked after it."""
    it = _Peek(lines)
    prev: Line | None = None
    before: Line | None = None
    for no, raw in it:
        expect = None if anchored and prev is None else (prev.record["seq"] + 1 if prev else 1)
        line = Line(no, raw, record := parse_line(no, raw, expect), link_of(raw, record))
        if not (anchored and prev is None):
            _check(line, prev, before, it)
        before, prev = prev, line
        yield line


def _fits(item: tuple[int, bytes] | None, seq: int, prev: str) -> bool:
    if item is None:
        return False
    try:
        record = json.loads(item[1])
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("seq") == seq and record.get("prev") == prev


def _check(line: Line, prev: Line | None, before: Line | None, ahead: _Peek) -> None:
    """Broken unless ``line`` follows ``prev`` (``before``: the line before that; ``ahead``: the lines after)."""
    want_seq = prev.record["seq"] + 1 if prev else 1
    want_prev = prev.link if prev else GENESIS
    seq, no = line.record["seq"], line.no
    if seq == want_seq and line.record["prev"] == want_prev:
        return
    if _fits(ahead.peek(), want_seq, want_prev):  # the next line follows the previous one: this one is extra
        raise Broken(f"a record was inserted at line {no} (seq {seq})", no, seq)
    if prev is not None and seq == prev.record["seq"] and line.record["prev"] == (before.link if before else GENESIS):
        p = prev.record["seq"]  # this line links past the previous one, which took its place
        raise Broken(f"a record was inserted at line {prev.no} (seq {p})", prev.no, p)
    if seq > want_seq:
        gap = f"record seq {want_seq}" if seq == want_seq + 1 else f"records seq {want_seq}..{seq - 1}"
        raise Broken(f"{gap} deleted before line {no}", no, want_seq)
    if seq < want_seq:
        raise Broken(f"a record was inserted at line {no} (seq {seq})", no, seq)
    if prev is None:
        raise Broken("line 1 does not begin an audit log: its prev is not the genesis hash "
                     "(records before it deleted, or it was edited)", no, seq)
    p = prev.record["seq"]
    raise Broken(f"record seq {p} (line {prev.no}) was edited", prev.no, p)


def _ranges_of(line: Line) -> list[tuple[int, int]]:
    """The seq ranges a retention record lists (``removed`` and ``carried``); Broken if malformed."""
    out = []
    for key in ("removed", "carried"):
        value = line.record.get(key, [])
        ok = isinstance(value, list) and all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in value)
        if not ok:
            raise Broken(f"line {line.no}: the retention record's {key} is not a list of [first, last] seqs",
                         line.no, line.record["seq"])
        out += [(a, b) for a, b in value]
    return out


def _cover(line: Line, pending: dict[int, int]) -> None:
    """Notes a tombstone (seq -> line) in ``pending``; a retention record takes those it lists out."""
    record = line.record
    if "tombstone" in record:
        pending[record["seq"]] = line.no
    elif record["kind"] == "retention" and pending:
        for a, b in _ranges_of(line):
            if b - a < len(pending):
                for s in range(a, b + 1):
                    pending.pop(s, None)
            else:
                for s in [s for s in pending if a <= s <= b]:
                    del pending[s]


def check_lines(lines: Iterable[tuple[int, bytes]], head: str | None = None) -> VerifyResult:
    """The whole check over numbered lines (see the module docstring); the first problem found."""
    count, last, pending = 0, None, {}
    seen = head is None or head == GENESIS
    try:
        for line in walk(iter(lines)):
            count, last = count + 1, line
            _cover(line, pending)
            seen = seen or line.link == head
    except Broken as exc:
        return VerifyResult(False, count, last.link if last else GENESIS, exc.problem, exc.line, exc.seq)
    top = last.link if last else GENESIS
    if pending:
        seq, no = min(pending.items(), key=lambda kv: kv[1])
        return VerifyResult(False, count, top, f"record seq {seq} (line {no}) was deleted without a retention record",
                            no, seq)
    if not seen:
        if last is None:
            return VerifyResult(False, 0, top, f"the log is empty: it does not contain head {head}", None, None)
        seq = last.record["seq"]
        return VerifyResult(False, count, top, f"the log does not contain head {head}: its last record (seq {seq}, "
                            f"line {last.no}) was edited, or records after it were removed", last.no, seq)
    return VerifyResult(True, count, top)
