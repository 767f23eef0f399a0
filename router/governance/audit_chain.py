"""Checking an audit log's hash chain (router/governance/audit.py writes it): each
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
- a record dated before the one before it (times never go back; a
  tombstone's line is not hashed, so this is what keeps its time between
  its neighbours'): "record seq K (line N) is dated T, before seq K-1
  (line N-1, T'): record times never go back ...";
- a tombstone that the retention record covering it does not show as due:
  its time after that record's ``cutoffs`` for its tenant: "record seq K
  (line N) was deleted before its retention (time T, cutoff C)";
- a ``head`` noted earlier that the log no longer contains: its end was
  edited or cut off.

The last record's own edit leaves nothing after it to disagree: only the
next append's ``prev`` (or a noted head) shows it."""

from __future__ import annotations

import datetime
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


def parse_time(text: str) -> datetime.datetime:
    """A record's ``time`` (or any ISO-8601 time; naive = UTC) as an aware datetime; ValueError if not one."""
    when = datetime.datetime.fromisoformat(text)
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)


def owner_of(record: dict) -> str:
    """Whose record it is, as retention counts it: its ``tenant``, or "" for a record of no tenant."""
    return str(record["tenant"]) if "tenant" in record else ""


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


def listed_ranges(line: Line) -> list[tuple[int, int]]:
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


def listed_cutoffs(line: Line) -> dict[str, tuple[datetime.datetime, str]]:
    """A retention record's ``cutoffs`` ({owner: ISO time}) as {owner: (time, text)}; Broken if malformed.
    A record without them (an older log's) lists none: every tombstone it covers then fails the check."""
    value = line.record.get("cutoffs", {})
    bad = Broken(f"line {line.no}: the retention record's cutoffs is not an object of tenant: ISO-8601 time",
                 line.no, line.record["seq"])
    if not isinstance(value, dict):
        raise bad
    out = {}
    for owner, text in value.items():
        try:
            out[owner] = (parse_time(text), text)
        except (TypeError, ValueError):
            raise bad from None
    return out


@dataclass(slots=True)
class _Stone:
    """A tombstone waiting for the retention record that covers it."""

    no: int
    text: str
    when: datetime.datetime
    owner: str


class Checker:
    """Follows the lines :func:`walk` yields (each already fits the chain):
    times that never go back, tombstones and the retention records that
    cover them, a noted ``head``. :meth:`feed` raises Broken at a problem;
    :meth:`result` is the verdict once every line is fed."""

    def __init__(self, head: str | None = None) -> None:
        self.count = 0
        self.last: Line | None = None
        self.time: datetime.datetime | None = None
        """The time of the last line fed."""
        self.pending: dict[int, _Stone] = {}
        self._head = head
        self._seen = head is None or head == GENESIS

    def feed(self, line: Line) -> datetime.datetime:
        """Takes the next line; its time. Broken if it does not fit (then it is not counted)."""
        when = self._check_time(line)
        self.count, self.last, self.time = self.count + 1, line, when
        record = line.record
        if "tombstone" in record:
            self.pending[record["seq"]] = _Stone(line.no, record["time"], when, owner_of(record))
        elif record["kind"] == "retention":
            self._cover(line)
        self._seen = self._seen or line.link == self._head
        return when

    def _check_time(self, line: Line) -> datetime.datetime:
        seq, no, text = line.record["seq"], line.no, line.record["time"]
        try:
            when = parse_time(text)
        except ValueError:
            raise Broken(f"line {no}: its time {text!r} is not an ISO-8601 time", no, seq) from None
        if self.time is not None and self.last is not None and when < self.time:  # both set by each line
            p = self.last.record
            raise Broken(f"record seq {seq} (line {no}) is dated {text}, before seq {p['seq']} (line {self.last.no}, "
                         f"{p['time']}): record times never go back (one of the two was edited or moved)", no, seq)
        return when

    def _cover(self, line: Line) -> None:
        """Takes the tombstones a retention record lists out of ``pending``;
        Broken if one of them is dated after the record's cutoff for its tenant."""
        ranges, cutoffs = listed_ranges(line), listed_cutoffs(line)
        late = [(seq, stone) for seq, stone in self._take(ranges)
                if stone.owner not in cutoffs or stone.when > cutoffs[stone.owner][0]]
        if not late:
            return
        seq, stone = min(late, key=lambda kv: kv[1].no)
        if stone.owner in cutoffs:
            why = f"cutoff {cutoffs[stone.owner][1]}"
        else:
            who = f"tenant {stone.owner!r}" if stone.owner else "records of no tenant"
            why = f"no cutoff for {who} in the retention record at line {line.no}"
        raise Broken(f"record seq {seq} (line {stone.no}) was deleted before its retention (time {stone.text}, {why})",
                     stone.no, seq)

    def _take(self, ranges: list[tuple[int, int]]) -> list[tuple[int, _Stone]]:
        out = []
        for a, b in ranges:
            if b - a < len(self.pending):
                out += [(s, self.pending.pop(s)) for s in range(a, b + 1) if s in self.pending]
            else:
                out += [(s, self.pending.pop(s)) for s in [s for s in self.pending if a <= s <= b]]
        return out

    def broken(self, exc: Broken) -> VerifyResult:
        """The verdict at a problem :func:`walk` or :meth:`feed` raised."""
        return VerifyResult(False, self.count, self.last.link if self.last else GENESIS, exc.problem, exc.line,
                            exc.seq)

    def result(self) -> VerifyResult:
        """The verdict once every line is fed: tombstones left uncovered, a noted head not seen."""
        last, count = self.last, self.count
        top = last.link if last else GENESIS
        if self.pending:
            seq, stone = min(self.pending.items(), key=lambda kv: kv[1].no)
            return VerifyResult(False, count, top, f"record seq {seq} (line {stone.no}) was deleted without a "
                                f"retention record", stone.no, seq)
        if not self._seen:
            head = self._head
            if last is None:
                return VerifyResult(False, 0, top, f"the log is empty: it does not contain head {head}", None, None)
            seq = last.record["seq"]
            return VerifyResult(False, count, top, f"the log does not contain head {head}: its last record (seq "
                                f"{seq}, line {last.no}) was edited, or records after it were removed", last.no, seq)
        return VerifyResult(True, count, top)


def check_lines(lines: Iterable[tuple[int, bytes]], head: str | None = None) -> VerifyResult:
    """The whole check over numbered lines (see the module docstring); the first problem found."""
    checker = Checker(head)
    try:
        for line in walk(iter(lines)):
            checker.feed(line)
    except Broken as exc:
        return checker.broken(exc)
    return checker.result()
