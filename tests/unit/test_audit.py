"""The audit log on real files: a log of mixed records verifies; an edited,
deleted, inserted or out-of-time line is found and named (line and seq); a
torn last line is moved aside and noted, a complete bad one refused;
retention tombstones and their retention record land in one atomic rewrite
and keep the chain whole, a tombstone forged without a retention record or
before its cutoff is found; a sweep with nothing expired reads little and
writes nothing; a noted head (or the ``.head`` file) finds the end edited or
cut off; the log resumes its chain when reopened, refuses to continue a
broken one, turns every write failure into an AuditError, and is private
(0600 in a 0700 folder); query filters; and the ``kvrelay audit`` commands
over the same files."""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import stat
import tempfile
import threading
from pathlib import Path

import pytest

import kvrelay.router.governance.audit as audit
from kvrelay.cli.main import main
from kvrelay.router.governance.audit import (
    GENESIS,
    OTHER_TENANTS,
    AuditError,
    AuditLog,
    RecordKind,
    head_path,
    iso_time,
    query,
    verify,
)
from kvrelay.router.governance.retention import DAY_S, RetentionSweeper
from kvrelay.runtime.config import parse_config

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _fill(path: Path, n: int = 20, clock: Clock | None = None) -> AuditLog:
    """A log of ``n`` mixed records, one minute apart (request records alternate tenants a and b)."""
    clock = clock or Clock()
    log = AuditLog(path, clock=clock, fsync=False)
    for i in range(n):
        clock.t += 60
        if i % 5 == 4:
            log.append(RecordKind.OPERATOR, {"operator": "ops", "action": "scale", "site": "montreal"})
        elif i % 7 == 6:
            log.append(RecordKind.REGISTRATION, {"worker_id": f"w{i}", "site": "toronto"})
        else:
            log.append(RecordKind.REQUEST, {
                "tenant": "a" if i % 2 else "b", "request_id": f"r{i}", "prefill_site": "toronto",
                "decode_site": "montreal" if i % 3 else "toronto", "prompt_tokens": 10 + i,
                "completion_tokens": 4, "outcome": "ok"})
    return log


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(x + b"\n" for x in lines))


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    path = tmp_path / "audit" / "audit.jsonl"
    _fill(path).close()
    return path


def test_a_log_of_mixed_records_verifies(log_path):
    result = verify(log_path)
    assert result.ok and result.records == 20 and result.problem is None
    lines = _lines(log_path)
    assert result.head == hashlib.sha256(lines[-1]).hexdigest()
    first, second = json.loads(lines[0]), json.loads(lines[1])
    assert list(first)[:4] == ["seq", "time", "kind", "prev"]
    assert first["seq"] == 1 and first["prev"] == GENESIS == hashlib.sha256(b"kvrelay audit log v1").hexdigest()
    assert second["prev"] == hashlib.sha256(lines[0]).hexdigest()
    assert first["time"] == "2027-01-15T08:01:00.000Z"
    assert iso_time(T0 + 0.1234) == "2027-01-15T08:00:00.123Z"


def test_an_edited_token_count_names_the_record(log_path):
    lines = _lines(log_path)
    assert b'"prompt_tokens":17' in lines[7]
    lines[7] = lines[7].replace(b'"prompt_tokens":17', b'"prompt_tokens":1')
    _write(log_path, lines)
    result = verify(log_path)
    assert not result.ok and (result.line, result.seq) == (8, 8)
    assert result.problem == "record seq 8 (line 8) was edited"


def test_a_deleted_line_names_the_gap(log_path):
    lines = _lines(log_path)
    _write(log_path, lines[:5] + lines[6:])
    result = verify(log_path)
    assert result.problem == "record seq 6 deleted before line 6" and (result.line, result.seq) == (6, 6)
    _write(log_path, lines[:5] + lines[9:])
    assert verify(log_path).problem == "records seq 6..9 deleted before line 6"
    _write(log_path, lines[1:])  # the first one
    assert verify(log_path).problem == "record seq 1 deleted before line 1"


def test_an_inserted_line_is_named_copied_or_forged(log_path):
    lines = _lines(log_path)
    _write(log_path, lines[:10] + [lines[3]] + lines[10:])  # a copy of seq 4 after seq 10
    result = verify(log_path)
    assert result.problem == "a record was inserted at line 11 (seq 4)" and (result.line, result.seq) == (11, 4)
    # a forgery made to fit after line 10 (seq 11, prev = line 10's hash): found at the next line, named itself
    forged = json.dumps({"seq": 11, "time": "2027-01-15T08:10:30.000Z", "kind": "request",
                         "prev": hashlib.sha256(lines[9]).hexdigest(), "tenant": "a"}, separators=(",", ":"))
    _write(log_path, lines[:10] + [forged.encode()] + lines[10:])
    result = verify(log_path)
    assert result.problem == "a record was inserted at line 11 (seq 11)" and result.line == 11
    # one that fits nowhere (seq 11 again, another prev)
    stray = json.dumps({"seq": 11, "time": "x", "kind": "request", "prev": "0" * 64}, separators=(",", ":"))
    _write(log_path, lines[:10] + [stray.encode()] + lines[10:])
    assert verify(log_path).problem == "a record was inserted at line 11 (seq 11)"


def test_a_torn_last_line_is_moved_aside_and_noted_in_the_chain(log_path):
    data = log_path.read_bytes()
    lines = _lines(log_path)
    head_path(log_path).write_text(f"19 {hashlib.sha256(lines[18]).hexdigest()}\n")  # as the crash left it
    cut = data[:-len(lines[-1]) // 2 - 1]  # the last line cut halfway, as a crash mid-write would
    log_path.write_bytes(cut)
    torn = cut[len(data) - len(lines[-1]) - 1:]
    result = verify(log_path)
    assert not result.ok and result.line == 20 and result.records == 19
    assert result.problem == "line 20 is incomplete (no newline at its end: a write cut short?)"
    clock = Clock(T0 + 3600)
    log = AuditLog(log_path, clock=clock, fsync=False)  # the router starts: the log is evidence, not a gate
    moved = log_path.parent / f"audit.jsonl.torn-{int(clock.t)}"
    assert moved.read_bytes() == torn and stat.S_IMODE(moved.stat().st_mode) == 0o600
    record = json.loads(_lines(log_path)[-1])
    assert log.seq == 20 and record["seq"] == 20 and record["kind"] == RecordKind.RECOVERY == "recovery"
    assert {k: record[k] for k in ("action", "bytes", "file")} == {
        "action": "torn tail moved", "bytes": len(torn), "file": moved.name}
    assert head_path(log_path).read_text() == f"20 {log.head}\n"  # on disk (synced) and noted
    log.append(RecordKind.OPERATOR, {"operator": "ops"})
    log.close()
    assert log_path.read_bytes().startswith(data[:-len(lines[-1]) - 1])
    assert verify(log_path).ok and verify(log_path).records == 21
    lone = log_path.parent / "lone.jsonl"  # nothing but a torn first line
    lone.write_bytes(b'{"seq":1,"ti')
    with AuditLog(lone, clock=clock) as log:
        assert log.seq == 1
    assert (log_path.parent / f"lone.jsonl.torn-{int(clock.t)}").read_bytes() == b'{"seq":1,"ti'
    assert verify(lone).ok


def test_a_complete_last_line_that_is_not_a_record_is_refused(log_path):
    data = log_path.read_bytes()
    last = _lines(log_path)[-1]
    log_path.write_bytes(data[:-len(last) - 1] + b'{"seq": 20, "ti\n')  # newline and all: not a crash
    assert verify(log_path).problem == "line 20 is not a JSON record (where seq 20 was expected)"
    with pytest.raises(AuditError, match="line 20 is not a JSON record") as err:
        AuditLog(log_path)
    assert str(log_path) in str(err.value) and err.value.line == 20
    assert log_path.read_bytes() == data[:-len(last) - 1] + b'{"seq": 20, "ti\n'  # left as it was
    assert not list(log_path.parent.glob("*.torn-*"))


def test_the_last_record_edited_is_refused_on_reopen_only_through_its_successor(log_path):
    lines = _lines(log_path)
    lines[-2] = lines[-2].replace(b'"completion_tokens":4', b'"completion_tokens":40')
    _write(log_path, lines)
    with pytest.raises(AuditError, match=r"record seq 19 \(line 19\) was edited"):
        AuditLog(log_path)


def test_a_noted_head_finds_the_end_edited_or_cut_off(log_path):
    head = verify(log_path).head
    log = AuditLog(log_path, fsync=False)
    log.append(RecordKind.OPERATOR, {"operator": "ops"})
    log.close()
    assert verify(log_path, head=head).ok  # the log grew past the noted head: fine
    lines = _lines(log_path)
    _write(log_path, lines[:-2])  # the last two cut off: the chain alone cannot tell
    assert verify(log_path).ok
    result = verify(log_path, head=head)
    assert not result.ok and (result.line, result.seq) == (19, 19)
    assert result.problem.startswith(f"the log does not contain head {head}: its last record (seq 19, line 19)")
    assert b'"action":"scale"' in lines[19]
    lines[19] = lines[19].replace(b'"action":"scale"', b'"action":"drain"')  # the noted record itself, edited
    _write(log_path, lines[:20])
    assert not verify(log_path, head=head).ok


def test_reopening_continues_seq_and_chain(log_path):
    log = AuditLog(log_path, fsync=False)
    assert log.seq == 20 and log.head == verify(log_path).head
    record = log.append(RecordKind.JOB, {"action": "deleted", "job": "j1", "tenant": "a"})
    log.close()
    assert record["seq"] == 21 and record["prev"] == hashlib.sha256(_lines(log_path)[19]).hexdigest()
    assert verify(log_path).ok and verify(log_path).records == 21


def test_file_is_0600_in_a_0700_folder(tmp_path):
    folder = tmp_path / "new" / "audit"
    AuditLog(folder / "audit.jsonl").close()
    assert stat.S_IMODE((folder / "audit.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    (loose / "audit.jsonl").write_bytes(b"")
    os.chmod(loose / "audit.jsonl", 0o644)
    AuditLog(loose / "audit.jsonl").close()  # an existing folder of the log's own, and the file, made private
    assert stat.S_IMODE((loose / "audit.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    shared = tmp_path / "cache"  # a folder shared with other files (models): its mode stays, the log is 0600
    (shared / "models").mkdir(parents=True)
    os.chmod(shared, 0o755)
    AuditLog(shared / "audit.jsonl").close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert stat.S_IMODE((shared / "audit.jsonl").stat().st_mode) == 0o600


def test_reserved_fields_and_values_json_cannot_hold_are_refused(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", fsync=False)
    for bad in ({"seq": 5}, {"prev": "x"}, {"tombstone": "0" * 64}):
        with pytest.raises(ValueError, match="written by the log itself"):
            log.append(RecordKind.REQUEST, bad)
    with pytest.raises(ValueError, match="not JSON"):
        log.append(RecordKind.REQUEST, {"x": float("nan")})
    for kind in ("refusal", "request", "nonsense"):  # a plain string: no `--kind` query could rely on it
        with pytest.raises(ValueError, match="is not a RecordKind"):
            log.append(kind, {"tenant": "a"})  # type: ignore[arg-type]
    log.append(RecordKind.REQUEST, {"tenant": "a", "text": "line\nbreak \u2028 é"})
    log.close()
    assert verify(tmp_path / "a.jsonl").records == 1  # nothing half-written by the refusals


def test_appends_from_threads_keep_one_chain(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", fsync=False)
    threads = [threading.Thread(target=lambda k=k: [log.append(RecordKind.REQUEST, {"tenant": f"t{k}", "i": i})
                                                    for i in range(50)]) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    log.close()
    result = verify(tmp_path / "a.jsonl")
    assert result.ok and result.records == 200


def test_sweep_tombstones_keep_the_chain_and_are_listed(log_path):
    clock = Clock(T0 + 86_400)
    log = AuditLog(log_path, clock=clock, fsync=False)

    def expired(r: dict) -> bool:
        return (r.get("tenant") == "a" or r["kind"] == "registration") and r["seq"] <= 8
    result = log.sweep(expired)
    assert result.counts == {"a": 4, "": 1} and result.removed == [(2, 2), (4, 4), (6, 8)]
    assert result.record["kind"] == "retention" and result.record["seq"] == 21
    assert result.record["removed"] == [[2, 2], [4, 4], [6, 8]] and result.record["counts"] == {"a": 4, "": 1}
    # no cutoffs given: a tenant's is the time of its youngest record removed (seq 8 of a, seq 7 of none)
    assert result.record["cutoffs"] == {"": iso_time(T0 + 7 * 60), "a": iso_time(T0 + 8 * 60)}
    assert [r["seq"] for r in query(log_path, tenant="a")] == [12, 16, 18]
    lines = [json.loads(x) for x in _lines(log_path)]
    assert set(lines[1]) == {"seq", "time", "kind", "prev", "tenant", "tombstone"} and lines[1]["tenant"] == "a"
    assert "request_id" not in lines[1]
    assert verify(log_path).ok
    assert log.sweep(expired).record is None  # nothing more: nothing written
    assert log.sweep(lambda r: False).record is None and verify(log_path).records == 21
    # the retention record itself expires later: what it listed is carried into the next one
    again = log.sweep(lambda r: r["kind"] == "retention" or r["seq"] == 1)
    assert again.counts == {"": 1, "b": 1} and again.record["carried"] == result.record["removed"]
    log.append(RecordKind.OPERATOR, {"operator": "ops"})  # appends go on into the new file
    log.close()
    assert verify(log_path).ok and verify(log_path).records == 23
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
    assert sorted(p.name for p in log_path.parent.iterdir()) == ["audit.jsonl", "audit.jsonl.head"]  # no temp file


def test_a_tombstone_without_a_retention_record_is_a_deletion(log_path):
    lines = _lines(log_path)
    original = json.loads(lines[4])
    stone = {k: original[k] for k in ("seq", "time", "kind", "prev")}
    stone["tombstone"] = hashlib.sha256(lines[4]).hexdigest()
    lines[4] = json.dumps(stone, separators=(",", ":")).encode()
    _write(log_path, lines)
    result = verify(log_path)
    assert result.problem == "record seq 5 (line 5) was deleted without a retention record"
    assert (result.line, result.seq) == (5, 5)
    with pytest.raises(AuditError, match="deleted without a retention record; not swept"):
        AuditLog(log_path, fsync=False).sweep(lambda r: True)


def test_sweep_refuses_a_log_that_does_not_verify(log_path):
    lines = _lines(log_path)
    lines[2] = lines[2].replace(b'"prompt_tokens":12', b'"prompt_tokens":2')
    _write(log_path, lines)
    before = log_path.read_bytes()
    with pytest.raises(AuditError, match=r"record seq 3 \(line 3\) was edited; not swept"):
        AuditLog(log_path, fsync=False).sweep(lambda r: True)
    assert log_path.read_bytes() == before


def test_query_filters_by_tenant_site_since_and_kind(log_path):
    assert {r["tenant"] for r in query(log_path, tenant="a")} == {"a"}
    assert [r["seq"] for r in query(log_path, tenant="a")] == [2, 4, 6, 8, 12, 16, 18]
    assert len(list(query(log_path, kind="operator"))) == 4
    assert {r["kind"] for r in query(log_path, site="montreal")} == {"request", "operator"}
    assert all("montreal" in (r.get("decode_site"), r.get("site")) for r in query(log_path, site="montreal"))
    since = datetime.datetime.fromtimestamp(T0 + 15 * 60, datetime.UTC)
    assert [r["seq"] for r in query(log_path, since=since)] == list(range(15, 21))
    assert [r["seq"] for r in query(log_path, since=since.replace(tzinfo=None))] == list(range(15, 21))
    assert [r["seq"] for r in query(log_path, tenant="b", kind="request", site="toronto", since=since)] == [17, 19]
    AuditLog(log_path, fsync=False).sweep(lambda r: r.get("tenant") == "a")
    assert list(query(log_path, tenant="a")) == []  # tombstones are not records


def _stone(line: bytes) -> bytes:
    """The tombstone a sweep would write for ``line``."""
    original = json.loads(line)
    stone = {k: original[k] for k in ("seq", "time", "kind", "prev")}
    if "tenant" in original:
        stone["tenant"] = original["tenant"]
    stone["tombstone"] = hashlib.sha256(line).hexdigest()
    return json.dumps(stone, separators=(",", ":")).encode()


def _chained(lines: list[bytes], time: str, kind: str, **fields) -> bytes:
    """A record forged to fit after ``lines`` (what anyone who can write the file can do)."""
    last = json.loads(lines[-1])
    prev = last["tombstone"] if "tombstone" in last else hashlib.sha256(lines[-1]).hexdigest()
    record = {"seq": last["seq"] + 1, "time": time, "kind": kind, "prev": prev, **fields}
    return json.dumps(record, separators=(",", ":")).encode()


def test_a_sweep_renames_its_tombstones_and_retention_record_into_place_together(log_path, monkeypatch):
    log = AuditLog(log_path, clock=Clock(T0 + 86_400), fsync=False)
    renamed, real = [], os.replace

    def replace(src, dst):
        if str(src).endswith(".sweep"):
            renamed.append(json.loads(Path(src).read_bytes().splitlines()[-1]))
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)

    def full_disk(data: bytes) -> None:  # appends fail from now on: the sweep needs none
        raise AuditError(log_path, "cannot write a record: No space left on device")
    monkeypatch.setattr(log, "_write", full_disk)
    result = log.sweep(lambda r: r.get("tenant") == "a")
    assert renamed == [result.record] and result.record["kind"] == "retention"  # in the file before its rename
    assert log.seq == 21 and head_path(log_path).read_text() == f"21 {log.head}\n"
    assert verify(log_path).ok


def test_a_sweep_that_fails_before_its_rename_leaves_the_log_as_it_was(log_path, monkeypatch):
    before = log_path.read_bytes()
    log = AuditLog(log_path, clock=Clock(T0 + 86_400), fsync=False)

    def replace(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(AuditError, match="cannot sweep: No space left on device; not swept"):
        log.sweep(lambda r: r.get("tenant") == "a")
    monkeypatch.undo()
    assert log_path.read_bytes() == before and log.seq == 20
    assert not list(log_path.parent.glob(".*.sweep"))
    assert log.sweep(lambda r: r.get("tenant") == "a").record["seq"] == 21  # the next one runs
    log.close()
    assert verify(log_path).ok


def test_a_sweep_with_cutoffs_removes_only_records_past_them_and_notes_them(log_path):
    log = AuditLog(log_path, clock=Clock(T0 + 86_400), fsync=False)
    cutoffs = {"a": T0 + 10 * 60 + 30, "": T0 + 5 * 60 + 30, OTHER_TENANTS: T0 + 3 * 60 + 30}
    result = log.sweep(lambda r: True, cutoffs)  # expired says yes to all: the cutoffs still hold
    assert result.removed == [(1, 6), (8, 8)] and result.counts == {"b": 2, "a": 4, "": 1}
    assert result.record["cutoffs"] == {"": iso_time(cutoffs[""]), "a": iso_time(cutoffs["a"]),
                                        "b": iso_time(cutoffs[OTHER_TENANTS])}  # b is named by no cutoff: "*"
    assert verify(log_path).ok
    with pytest.raises(ValueError, match="sweep cutoff for 'a' is not a Unix time: 'soon'"):
        log.sweep(lambda r: True, {"a": "soon"})
    log.close()


def test_a_sweep_with_nothing_expired_reads_only_the_old_records_and_writes_nothing(log_path, monkeypatch):
    read, made = [], []
    real_lines, real_mkstemp = audit.raw_lines, tempfile.mkstemp

    def counting(f, limit=None):
        for item in real_lines(f, limit):
            read.append(item[0])
            yield item
    monkeypatch.setattr(audit, "raw_lines", counting)
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: made.append(a) or real_mkstemp(*a, **k))
    log = AuditLog(log_path, fsync=False)
    result = log.sweep(lambda r: False, {"a": T0 + 3 * 60 + 30, "": T0})
    assert result.record is None and result.counts == {} and made == []
    assert max(read) == 4  # seq 4 (08:04) is younger than every cutoff: the scan stops there
    log.close()


def test_sweep_files_a_crash_left_are_deleted_on_open(log_path):
    stale = log_path.parent / ".audit.jsonl.k2j3x.sweep"
    stale.write_bytes(b'{"seq":2,"tenant":"a","prompt":"past its retention"}\n')
    other = log_path.parent / ".other.jsonl.k2j3x.sweep"  # another log's: not this one's to delete
    other.write_bytes(b"")
    AuditLog(log_path, fsync=False).close()
    assert not stale.exists() and other.exists()


def test_a_deletion_before_its_cutoff_is_found(log_path):
    lines = _lines(log_path)
    assert json.loads(lines[15])["tenant"] == "a" and json.loads(lines[15])["time"] == "2027-01-15T08:16:00.000Z"
    lines[15] = _stone(lines[15])  # a forger tombstones seq 16 and appends a retention record for it
    covering = {"removed": [[16, 16]], "counts": {"a": 1}}
    _write(log_path, lines + [_chained(lines, "2027-01-15T09:00:00.000Z", "retention", **covering,
                                       cutoffs={"a": "2027-01-15T08:10:00.000Z"})])
    result = verify(log_path)
    assert result.problem == ("record seq 16 (line 16) was deleted before its retention "
                              "(time 2027-01-15T08:16:00.000Z, cutoff 2027-01-15T08:10:00.000Z)")
    assert (result.line, result.seq) == (16, 16)
    _write(log_path, lines + [_chained(lines, "2027-01-15T09:00:00.000Z", "retention", **covering)])
    assert verify(log_path).problem == ("record seq 16 (line 16) was deleted before its retention (time "
                                        "2027-01-15T08:16:00.000Z, no cutoff for tenant 'a' in the retention "
                                        "record at line 21)")
    _write(log_path, lines + [_chained(lines, "2027-01-15T09:00:00.000Z", "retention", **covering,
                                       cutoffs={"a": "not a time"})])
    assert verify(log_path).problem == "line 21: the retention record's cutoffs is not an object of tenant: " \
                                       "ISO-8601 time"
    # what a forger can still do: claim a cutoff after the record's time (the module docstring says so)
    _write(log_path, lines + [_chained(lines, "2027-01-15T09:00:00.000Z", "retention", **covering,
                                       cutoffs={"a": "2027-01-15T08:59:00.000Z"})])
    assert verify(log_path).ok


def test_record_times_never_go_back(log_path):
    lines = _lines(log_path)
    stone = json.loads(_stone(lines[9]))
    stone["time"] = "2027-01-15T08:01:30.000Z"  # a tombstone's line is not hashed: its time moved back
    _write(log_path, lines[:9] + [json.dumps(stone).encode()] + lines[10:])
    result = verify(log_path)
    assert result.problem == ("record seq 10 (line 10) is dated 2027-01-15T08:01:30.000Z, before seq 9 (line 9, "
                              "2027-01-15T08:09:00.000Z): record times never go back (one of the two was edited "
                              "or moved)")
    assert (result.line, result.seq) == (10, 10)
    stone["time"] = "2027-01-15T08:30:00.000Z"  # or forward, past the record after it
    _write(log_path, lines[:9] + [json.dumps(stone).encode()] + lines[10:])
    assert verify(log_path).problem.startswith("record seq 11 (line 11) is dated 2027-01-15T08:11:00.000Z, "
                                               "before seq 10 (line 10, 2027-01-15T08:30:00.000Z)")
    stone["time"] = "yesterday"
    _write(log_path, lines[:9] + [json.dumps(stone).encode()] + lines[10:])
    assert verify(log_path).problem == "line 10: its time 'yesterday' is not an ISO-8601 time"
    _write(log_path, lines)
    log = AuditLog(log_path, clock=Clock(T0), fsync=False)  # the clock stepped back 20 minutes
    assert log.append(RecordKind.OPERATOR, {"operator": "ops"})["time"] == json.loads(lines[-1])["time"]
    log.close()
    assert verify(log_path).ok


def test_the_retention_sweeper_notes_the_cutoffs_it_applies(tmp_path):
    cfg = parse_config({
        "sites": [{"name": "local", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}],
        "router": {"records": {"operator_audit_retention_days": 30}},
        "tenants": [{"name": "a", "audit_retention_days": 2}, {"name": "b", "audit_retention_days": 20}]})
    clock = Clock()
    log = AuditLog(tmp_path / "audit.jsonl", clock=clock, fsync=False)
    for who in ("a", "b", None, "zed", ""):  # zed: no tenant of the config (nor is ""): the defaults (365 days)
        clock.t += 60
        log.append(RecordKind.REQUEST if who is not None else RecordKind.OPERATOR,
                   {"tenant": who} if who is not None else {"operator": "ops"})
    sweeper = RetentionSweeper(cfg, None, log, clock=clock)
    clock.t = T0 + 3 * DAY_S
    assert sweeper.sweep_once().audit_records_deleted == {"a": 1}
    (record,) = query(log.path, kind="retention")
    assert record["cutoffs"] == {"a": iso_time(clock.t - 2 * DAY_S)}
    clock.t = T0 + 400 * DAY_S
    assert sweeper.sweep_once().audit_records_deleted == {"b": 1, "": 3, "zed": 1}
    last = list(query(log.path, kind="retention"))[-1]
    assert last["carried"] == [[1, 1]] and last["cutoffs"] == {
        "": iso_time(clock.t - 30 * DAY_S), "a": iso_time(T0 + DAY_S), "b": iso_time(clock.t - 20 * DAY_S),
        "zed": iso_time(clock.t - 365 * DAY_S)}
    log.close()
    assert verify(log.path).ok


# -- the .head file, write failures ---------------------------------------------------

def test_the_head_file_finds_the_end_edited_or_cut_while_the_log_was_closed(log_path, monkeypatch):
    lines = _lines(log_path)
    side = head_path(log_path)
    assert side.read_text() == f"20 {hashlib.sha256(lines[-1]).hexdigest()}\n"
    assert stat.S_IMODE(side.stat().st_mode) == 0o600
    edited = lines[:-1] + [lines[-1].replace(b'"action":"scale"', b'"action":"drain"')]
    _write(log_path, edited)
    assert verify(log_path).ok  # the chain alone cannot tell
    with pytest.raises(AuditError, match=r"record seq 20 \(line 20\) is not the one this log wrote") as err:
        AuditLog(log_path)
    assert "audit.jsonl.head notes" in str(err.value) and err.value.line == 20
    _write(log_path, lines[:17])
    with pytest.raises(AuditError, match=r"records after seq 17 are missing: audit.jsonl.head notes seq 20"):
        AuditLog(log_path)
    _write(log_path, lines)
    side.write_text(f"18 {hashlib.sha256(lines[17]).hexdigest()}\n")  # records appended after the last sync
    AuditLog(log_path).close()
    assert side.read_text() == f"20 {hashlib.sha256(lines[-1]).hexdigest()}\n"  # noted on close
    side.write_text(f"18 {hashlib.sha256(lines[16]).hexdigest()}\n")
    with pytest.raises(AuditError, match=r"record seq 18 \(line 18\) is not the one this log wrote"):
        AuditLog(log_path)
    monkeypatch.setattr(audit, "TAIL_LINES", 3)  # a head noted further back than the lines checked from the end
    side.write_text(f"5 {hashlib.sha256(lines[4]).hexdigest()}\n")
    AuditLog(log_path, fsync=False).close()
    side.write_text(f"5 {hashlib.sha256(lines[3]).hexdigest()}\n")
    with pytest.raises(AuditError, match=r"record seq 5 \(line 5\) is not the one this log wrote"):
        AuditLog(log_path)
    side.unlink()  # a first start (or a side file gone): nothing to check
    _write(log_path, edited)
    AuditLog(log_path, fsync=False).close()
    assert side.read_text() == f"20 {hashlib.sha256(edited[-1]).hexdigest()}\n"


def test_every_write_failure_is_an_audit_error(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl"
    log = AuditLog(path, fsync=False)
    log.append(RecordKind.REQUEST, {"tenant": "a"})

    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")
    with monkeypatch.context() as m:
        m.setattr(os, "fstat", eio)
        with pytest.raises(AuditError, match="cannot write a record: Input/output error"):
            log.append(RecordKind.REQUEST, {"tenant": "a"})
    real_write = os.write

    def half(fd, data):  # half a line written, then the disk is full, and the cut fails too
        real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(os, "write", half)
        m.setattr(os, "ftruncate", eio)
        with pytest.raises(AuditError, match="cannot write a record: No space left on device"):
            log.append_durable(RecordKind.JOB, {"action": "deleted", "job": "j1"})
    assert not path.read_bytes().endswith(b"\n")  # the half line is still there...
    log.append(RecordKind.JOB, {"action": "deleted", "job": "j1"})  # ...and cut before the next record
    log.close()
    result = verify(path)
    assert result.ok and result.records == 2


# -- kvrelay audit ----------------------------------------------------------------

def test_cli_verify_ok_and_broken(log_path, capsys):
    head = verify(log_path).head
    assert main(["audit", "verify", str(log_path)]) == 0
    assert capsys.readouterr().out.strip() == f"ok: 20 records, head {head}"
    assert main(["audit", "verify", str(log_path), "--head", head.upper()]) == 0
    capsys.readouterr()
    lines = _lines(log_path)
    lines[7] = lines[7].replace(b'"prompt_tokens":17', b'"prompt_tokens":170')
    _write(log_path, lines)
    assert main(["audit", "verify", str(log_path)]) == 1
    err = capsys.readouterr().err
    assert "record seq 8 (line 8) was edited" in err and str(log_path) in err
    _write(log_path, lines[:7])
    assert main(["audit", "verify", str(log_path), "--head", head]) == 1
    assert f"does not contain head {head}" in capsys.readouterr().err
    assert main(["audit", "verify", str(log_path), "--head", "abc"]) == 2
    assert "--head: 'abc' is not a SHA-256" in capsys.readouterr().err
    assert main(["audit", "verify", str(log_path.parent / "none.jsonl")]) == 2
    assert "none.jsonl: No such file" in capsys.readouterr().err


def test_cli_query_table_and_json(log_path, tmp_path, capsys):
    assert main(["audit", "query", "--file", str(log_path), "--tenant", "a", "--json"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["seq"] for r in out] == [2, 4, 6, 8, 12, 16, 18] and {r["tenant"] for r in out} == {"a"}
    assert main(["audit", "query", "--file", str(log_path), "--kind", "request", "--since",
                 "2027-01-15T08:15:00Z"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["TIME", "KIND", "TENANT", "REQUEST/OPERATOR", "SITES", "TOKENS", "OUTCOME"]
    assert len(rows) == 1 + 4
    assert rows[1].split() == ["2027-01-15T08:16:00.000Z", "request", "a", "r15", "toronto->toronto", "25+4", "ok"]
    assert main(["audit", "query", "--file", str(log_path), "--since", "yesterday"]) == 2
    assert "--since: 'yesterday' is not an ISO-8601 time" in capsys.readouterr().err
    # the default file: <cache dir>/audit.jsonl
    cache = tmp_path / "cache"
    assert main(["--cache-dir", str(cache), "audit", "query"]) == 2
    assert f"no audit log at {cache / 'audit.jsonl'}" in capsys.readouterr().err
    cache.mkdir()
    (cache / "audit.jsonl").write_bytes(log_path.read_bytes())
    assert main(["--cache-dir", str(cache), "audit", "query", "--site", "montreal", "--kind", "operator"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 5 and rows[1].split()[1:] == ["operator", "-", "ops", "montreal", "-", "scale"]


def test_verify_and_query_span_every_routers_chain(tmp_path, capsys):
    """Several routers, a chain each (audit.<router>.jsonl, as kvrelay serve keeps them): verify checks every
    chain and names the log and record of an edit in any; query merges their records in time order."""
    from kvrelay.cli.main import main
    logs = {}
    for i, name in enumerate(("qc", "ont", "bc")):
        logs[name] = tmp_path / f"audit.{name}.jsonl"
        _fill(logs[name], n=6, clock=Clock(T0 + 20 * i)).close()  # interleaved in time
    paths = [str(p) for p in logs.values()]
    assert main(["audit", "verify", *paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ok: ")[0] for line in out] == paths and all("6 records" in line for line in out)
    lines = _lines(logs["ont"])
    lines[2] = lines[2].replace(b'"prompt_tokens":12', b'"prompt_tokens":2')
    _write(logs["ont"], lines)
    assert main(["audit", "verify", *paths]) == 1
    captured = capsys.readouterr()
    assert f"kvrelay: {logs['ont']}: record seq 3 (line 3) was edited" in captured.err
    assert captured.out.count(": ok: ") == 2  # the other chains still verify
    assert main(["--cache-dir", str(tmp_path), "audit", "query", "--kind", "operator", "--json"]) == 0
    merged = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(merged) == 3 and [r["time"] for r in merged] == sorted(r["time"] for r in merged)
    assert main(["audit", "verify", "--head", "0" * 64, *paths]) == 2  # a head is one log's: refused with several
    assert "--head is one log's head" in capsys.readouterr().err
