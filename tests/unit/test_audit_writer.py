"""The router's audit writer on real files: records queued from many threads
land in order of their queueing per thread, the chain verifies, a durable
record is on disk when append_durable returns, and close writes the rest."""

from __future__ import annotations

import json
import threading

import pytest

from router.audit import AuditError, verify
from router.audit_writer import AuditWriter


def test_queued_records_are_written_in_batches_and_verify(tmp_path):
    w = AuditWriter(tmp_path / "a" / "audit.jsonl")

    def burst(t: int) -> None:
        for i in range(300):
            w.append("request", {"tenant": f"t{t}", "n": i})
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
    w.append_durable("job", {"action": "deleted", "job": "j1"})
    assert json.loads((tmp_path / "a" / "audit.jsonl").read_text().splitlines()[-1])["job"] == "j1"
    w.append("request", {"tenant": "late"})
    w.close()
    result = verify(tmp_path / "a" / "audit.jsonl")
    assert result.ok and result.records == 1202


def test_a_record_that_cannot_be_written_fails_its_durable_append(tmp_path):
    w = AuditWriter(tmp_path / "audit.jsonl")
    with pytest.raises(ValueError):  # a reserved field: the log refuses it, the caller is told
        w.append_durable("request", {"seq": 1})
    w.append("request", {"fine": True})
    w.close()
    assert verify(tmp_path / "audit.jsonl").records == 1
    with pytest.raises(AuditError):
        w.log.append("request", {"after": "close"})
