"""Signed audit heads (router/governance/audit_heads.py): the writer signs the
log's head when it opens and closes it and at intervals; `kvrelay audit verify
--heads` then finds a tail rewritten and re-chained, cut off, or appended to
while the router was stopped, which the hash chain alone cannot."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from kvrelay.cli.main import main
from kvrelay.launch.credentials import ensure_audit_key
from kvrelay.router.core.records import RecordKind
from kvrelay.router.governance.audit_heads import (
    HeadsError,
    HeadSigner,
    check_heads,
    generate_signing_key,
    heads_path,
    load_public_key,
    load_signing_key,
    read_heads,
)
from kvrelay.router.governance.audit_writer import AuditWriter


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(x + b"\n" for x in lines))


def _rechain(lines: list[bytes], start: int) -> list[bytes]:
    """``lines`` with every record from index ``start`` on given a ``prev`` that fits (a rewritten tail)."""
    out = lines[:start]
    for raw in lines[start:]:
        record = json.loads(raw)
        record["prev"] = hashlib.sha256(out[-1]).hexdigest()
        out.append(json.dumps(record, separators=(",", ":")).encode())
    return out


def _request(i: int) -> dict:
    return {"tenant": "lab", "request_id": f"r{i}", "prompt_tokens": 10 + i, "completion_tokens": 3, "outcome": "ok"}


class Run:
    """A log written by an :class:`AuditWriter` that signs its heads."""

    def __init__(self, folder: Path) -> None:
        self.log = folder / "audit" / "audit.jsonl"
        self.key = ensure_audit_key(folder / "keys")
        self.pub = self.key.with_name(self.key.name + ".pub")
        self.heads = heads_path(self.log)

    def session(self, n: int, interval_s: float = 60.0) -> None:
        """The router opens the log, writes ``n`` records, closes it."""
        writer = self.writer(interval_s)
        for i in range(n):
            writer.append(RecordKind.REQUEST, _request(i))
        writer.close()

    def writer(self, interval_s: float = 60.0) -> AuditWriter:
        signer = HeadSigner(load_signing_key(self.key), self.heads, self.log.name)
        return AuditWriter(self.log, signer=signer, head_interval_s=interval_s)

    def check(self):
        return check_heads(self.log, read_heads(self.heads, load_public_key(self.pub)))


@pytest.fixture
def run(tmp_path: Path) -> Run:
    r = Run(tmp_path)
    r.session(10)
    r.session(5)
    return r


def test_heads_are_signed_at_open_and_close_and_agree(run):
    heads = [json.loads(x) for x in _lines(run.heads)]
    assert [(h["state"], h["seq"]) for h in heads] == [("open", 0), ("closed", 10), ("open", 10), ("closed", 15)]
    assert all(h["log"] == "audit.jsonl" for h in heads)
    result = run.check()
    assert result.ok and result.heads == 4 and result.covered == 15 and result.uncovered == 0
    assert result.chain.records == 15


def test_a_truncated_tail_is_named(run):
    _write(run.log, _lines(run.log)[:12])  # the chain alone still holds
    result = run.check()
    assert result.chain.ok and not result.ok
    assert "the log ends at seq 12" in result.problem and "records 13..15 were cut from its end" in result.problem


def test_a_rewritten_and_rechained_tail_is_named(run):
    lines = _lines(run.log)
    edited = json.loads(lines[13])
    edited["prompt_tokens"] = 1  # seq 14's tokens made smaller, the tail re-chained so the chain holds
    lines[13] = json.dumps(edited, separators=(",", ":")).encode()
    _write(run.log, _rechain(lines, 14))
    result = run.check()
    assert result.chain.ok and not result.ok
    assert "record seq 15 (line 15) is not the one signed at" in result.problem


def test_a_forged_record_appended_after_close_is_named(run):
    lines = _lines(run.log)
    last = json.loads(lines[-1])
    forged = {"seq": 16, "time": last["time"], "kind": "request", "prev": hashlib.sha256(lines[-1]).hexdigest(),
              **_request(99)}
    _write(run.log, [*lines, json.dumps(forged, separators=(",", ":")).encode()])
    result = run.check()
    assert result.chain.ok and not result.ok
    assert "records seq 16..16 follow the head the router signed when it closed the log" in result.problem


def test_records_written_while_the_router_was_stopped_are_named(tmp_path):
    r = Run(tmp_path)
    r.session(4)
    unsigned = AuditWriter(r.log)  # someone writes with the log closed, chained, without the key
    unsigned.append(RecordKind.OPERATOR, {"operator": "x", "action": "scale"})
    unsigned.close()
    r.session(2)
    result = r.check()
    assert result.chain.ok and not result.ok
    assert "records seq 5..5 were written while the router was stopped" in result.problem


def test_a_running_router_signs_at_intervals_and_reports_what_is_not_yet_covered(tmp_path):
    r = Run(tmp_path)
    writer = r.writer(interval_s=0.2)
    try:
        for i in range(3):
            writer.append(RecordKind.REQUEST, _request(i))
        deadline = time.monotonic() + 10
        while b'"running"' not in (r.heads.read_bytes() if r.heads.exists() else b""):
            assert time.monotonic() < deadline, "no running head within 10 s"
            time.sleep(0.05)
        assert writer.flush()
        states = [json.loads(x)["state"] for x in _lines(r.heads)]
        assert states[0] == "open" and "running" in states and "closed" not in states
        writer.append(RecordKind.REQUEST, _request(9))
        assert writer.flush()
        result = r.check()
        assert result.ok and result.covered == 3 and result.uncovered >= 0
    finally:
        writer.close()
    assert r.check().ok and r.check().uncovered == 0


def test_an_altered_or_foreign_head_is_refused(run, tmp_path):
    lines = _lines(run.heads)
    head = json.loads(lines[-1])
    head["seq"] = 12  # a head moved back to let records 13..15 go
    _write(run.heads, [*lines[:-1], json.dumps(head).encode()])
    with pytest.raises(HeadsError, match="line 4: its signature does not verify"):
        read_heads(run.heads, load_public_key(run.pub))
    other = generate_signing_key(tmp_path / "other" / "k.key")
    with pytest.raises(HeadsError, match=r"line 1 was signed by key .*, not by the key given"):
        read_heads(run.heads, load_public_key(other))
    run.heads.write_text("not json\n")
    with pytest.raises(HeadsError, match="line 1 is not a signed head"):
        read_heads(run.heads, load_public_key(run.pub))


def test_keys_that_are_not_ed25519_keys_are_named(tmp_path):
    bad = tmp_path / "k.pem"
    bad.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(HeadsError, match="is not a PEM private key"):
        load_signing_key(bad)
    with pytest.raises(HeadsError, match="No such file"):
        load_signing_key(tmp_path / "missing.key")
    with pytest.raises(HeadsError, match="not a PEM Ed25519 public key"):
        load_public_key(bad)


def test_cli_verify_with_heads(run, capsys):
    args = ["audit", "verify", str(run.log), "--heads", str(run.heads), "--key", str(run.pub)]
    assert main(args) == 0
    assert "ok: 15 records" in capsys.readouterr().out
    assert main(["audit", "verify", str(run.log), "--heads", str(run.heads)]) == 2
    assert "--heads needs --key" in capsys.readouterr().err
    _write(run.log, _lines(run.log)[:14])
    assert main(args) == 1
    assert "records 15..15 were cut from its end" in capsys.readouterr().err
