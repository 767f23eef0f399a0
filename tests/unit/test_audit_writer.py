"""The router's audit writer on real files: records queued from many threads
land in order of their queueing per thread, the chain verifies, a durable
record is on disk when append_durable returns, each batch notes the head,
close writes the rest; an unexpected error never stops the writer, and a
full queue drops records, counts them and says so in the log."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from kvrelay.router.core.records import RecordKind
from kvrelay.router.governance.audit import AuditError, head_path, verify
from kvrelay.router.governance.audit_writer import AuditWriter


def test_queued_records_are_written_in_batches_and_verify(tmp_path):
    w = AuditWriter(tmp_path / "a" / "audit.jsonl")

    def burst(t: int) -> None:
        for i in range(300):
            w.append(RecordKind.REQUEST, {"tenant": f"t{t}", "n": i})
    threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert w.flush(10)
    lines = (tmp_path / "a" / "audit.jsonl").read_text().splitlines()
    assert len(lines) == 1200
    for t in range(4):  # each thread's records in its own order
        ns = [r["n"] for r in map(json.loads, lines) if r["tenant"] == f"t{t}"]
        assert ns == list(range(300))
    w.append_durable(RecordKind.JOB, {"action": "deleted", "job": "j1"})
    assert json.loads((tmp_path / "a" / "audit.jsonl").read_text().splitlines()[-1])["job"] == "j1"
    w.append(RecordKind.REQUEST, {"tenant": "late"})
    w.close()
    result = verify(tmp_path / "a" / "audit.jsonl")
    assert result.ok and result.records == 1202


def test_a_record_that_cannot_be_written_fails_its_durable_append(tmp_path):
    w = AuditWriter(tmp_path / "audit.jsonl")
    with pytest.raises(ValueError):  # a reserved field: the log refuses it, the caller is told
        w.append_durable(RecordKind.REQUEST, {"seq": 1})
    w.append(RecordKind.REQUEST, {"fine": True})
    w.close()
    assert verify(tmp_path / "audit.jsonl").records == 1
    with pytest.raises(AuditError):
        w.log.append(RecordKind.REQUEST, {"after": "close"})


def test_each_batch_notes_the_head(tmp_path):
    w = AuditWriter(tmp_path / "audit.jsonl")
    w.append(RecordKind.REQUEST, {"tenant": "a"})
    assert w.flush(10)
    assert head_path(w.path).read_text() == f"1 {w.log.head}\n"
    w.close()


def test_an_unexpected_error_never_stops_the_writer(tmp_path, monkeypatch, caplog):
    w = AuditWriter(tmp_path / "audit.jsonl")
    real_append, real_sync = w.log.append, w.log.sync

    def buggy(kind, fields):
        if fields.get("boom"):
            raise RuntimeError("a bug")
        return real_append(kind, fields)
    monkeypatch.setattr(w.log, "append", buggy)
    with caplog.at_level(logging.ERROR, logger="kvrelay.router.governance.audit_writer"):
        w.append(RecordKind.REQUEST, {"boom": True, "request_id": "r1"})
        with pytest.raises(AuditError, match="the job record was not written: RuntimeError"):
            w.append_durable(RecordKind.JOB, {"boom": True, "job": "j1"}, timeout_s=5)
        w.append(RecordKind.REQUEST, {"request_id": "r2"})
        assert w.flush(5)

        def broken_sync() -> None:
            raise RuntimeError("another bug")
        monkeypatch.setattr(w.log, "sync", broken_sync)
        with pytest.raises(AuditError, match="cannot sync: RuntimeError"):
            w.append_durable(RecordKind.JOB, {"job": "j2"}, timeout_s=5)
    assert "audit record request r1 was not written (unexpected error)" in caplog.text
    assert "audit records may not be on disk (unexpected error)" in caplog.text
    monkeypatch.setattr(w.log, "sync", real_sync)
    w.append(RecordKind.REQUEST, {"request_id": "r3"})
    w.close()
    records = [json.loads(x) for x in w.path.read_text().splitlines()]
    assert [r.get("request_id") or r.get("job") for r in records] == ["r2", "j2", "r3"]
    assert verify(w.path).ok


def test_a_full_queue_drops_records_counts_them_and_notes_them(tmp_path, monkeypatch, caplog):
    w = AuditWriter(tmp_path / "audit.jsonl", max_queued=5)
    inside, gate = threading.Event(), threading.Event()
    real_append = w.log.append

    def slow(kind, fields):
        if fields.get("first"):
            inside.set()
            gate.wait(10)
        return real_append(kind, fields)
    monkeypatch.setattr(w.log, "append", slow)
    w.append(RecordKind.REQUEST, {"first": True})
    assert inside.wait(10)  # the writer is busy with it: what comes now waits in the queue
    with caplog.at_level(logging.ERROR, logger="kvrelay.router.governance.audit_writer"):
        for i in range(8):
            w.append(RecordKind.REQUEST, {"request_id": f"r{i}"})
    assert w.dropped == 3
    assert caplog.text.count("audit queue full") == 1  # once a second at most
    assert "request record r5 dropped (1 dropped so far)" in caplog.text
    gate.set()
    assert w.flush(10)
    w.append(RecordKind.REQUEST, {"request_id": "after"})
    w.close()
    records = [json.loads(x) for x in w.path.read_text().splitlines()]
    assert [r.get("request_id") for r in records if r["kind"] == "request"] == [
        None, "r0", "r1", "r2", "r3", "r4", "after"]
    assert [(r["action"], r["count"]) for r in records if r["kind"] == "recovery"] == [("records dropped", 3)]
    assert verify(w.path).ok


def test_a_kind_that_is_not_a_record_kind_is_refused_by_the_caller_not_lost_in_the_thread(tmp_path):
    w = AuditWriter(tmp_path / "audit.jsonl")
    with pytest.raises(ValueError, match="is not a RecordKind"):
        w.append("refusal", {"api": "grpc"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a RecordKind"):
        w.append_durable("job", {"job": "j1"})  # type: ignore[arg-type]
    w.append(RecordKind.REFUSAL, {"api": "grpc"})
    w.close()
    assert [json.loads(x)["kind"] for x in w.path.read_text().splitlines()] == ["refusal"]
