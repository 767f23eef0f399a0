"""Signed audit heads (router/governance/audit_heads.py): the writer signs the
log's head when it opens and closes it and at intervals; `kvrelay audit verify
--heads` then finds a tail rewritten and re-chained, cut off, or appended to
while the router was stopped, which the hash chain alone cannot."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path

import pytest

from kvrelay.cli.main import main
from kvrelay.launch.credentials import ensure_audit_key
from kvrelay.router.core.records import RecordKind
from kvrelay.router.governance.audit_heads import (
    GENESIS_HEAD,
    HeadsError,
    HeadSigner,
    check_heads,
    digest,
    generate_signing_key,
    heads_path,
    key_id,
    load_public_key,
    load_signing_key,
    payload,
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


def test_the_heads_are_chained_across_the_routers_restarts(run):
    heads = [json.loads(x) for x in _lines(run.heads)]
    assert [h["n"] for h in heads] == [1, 2, 3, 4]
    assert heads[0]["prev"] == GENESIS_HEAD
    assert [h["prev"] for h in heads[1:]] == [digest(h) for h in heads[:-1]]  # each signs the one before
    result = run.check()
    assert result.ok and result.chained == 4 and result.unchained == 0


def test_hiding_records_written_while_stopped_by_removing_the_closed_head_is_named(tmp_path):
    """Issue 56, finding 6: records forged into the log while the router was stopped, then the head it
    signed closing the log taken out of the heads file, so no closed head precedes them. Before the
    heads were chained this passed (every remaining head verified and agreed); now the gap is named."""
    r = Run(tmp_path)
    r.session(4)
    unsigned = AuditWriter(r.log)
    unsigned.append(RecordKind.OPERATOR, {"operator": "x", "action": "scale"})
    unsigned.close()
    r.session(2)
    lines = _lines(r.heads)
    assert [json.loads(x)["state"] for x in lines] == ["open", "closed", "open", "closed"]
    _write(r.heads, [lines[0], *lines[2:]])
    result = r.check()
    assert result.chain.ok and not result.ok
    assert result.problem == ("expected head 2 after head 1 (heads line 1), found head 3 at heads line 2: "
                              "heads 2..2 were removed")


def test_heads_removed_from_the_start_or_reordered_are_named(run):
    lines = _lines(run.heads)
    _write(run.heads, lines[1:])
    assert "expected head 1 first, found head 2 at heads line 1: heads 1..1 were removed" in run.check().problem
    _write(run.heads, [lines[0], lines[2], lines[1], lines[3]])
    assert "expected head 2 after head 1 (heads line 1), found head 3" in run.check().problem


def test_heads_of_another_chain_spliced_in_are_named(run, tmp_path):
    """A head of the same key and number from another log's heads (or an earlier copy) put in place of one."""
    other = Run(tmp_path / "other")
    other.key, other.pub = run.key, run.pub  # the same router key, another chain
    other.session(10)
    other.session(5)
    mine, theirs = _lines(run.heads), _lines(other.heads)
    _write(run.heads, [*mine[:2], theirs[2], mine[3]])
    assert "head 3 (heads line 3) does not follow the head before it" in run.check().problem


def test_heads_signed_before_chaining_are_read_and_the_chain_goes_on_from_them(tmp_path):
    r = Run(tmp_path)
    key = load_signing_key(r.key)
    writer = AuditWriter(r.log)
    for i in range(3):
        writer.append(RecordKind.REQUEST, _request(i))
    writer.close()
    seq, head = 3, json.loads(_lines(r.log)[-1])
    legacy = {"log": r.log.name, "seq": seq, "head": hashlib.sha256(_lines(r.log)[-1]).hexdigest(),
              "time": head["time"], "state": "closed", "key": key_id(key.public_key())}
    legacy["sig"] = base64.b64encode(key.sign(payload(legacy))).decode()  # a head as kvrelay signed it before
    r.heads.write_text(json.dumps(legacy) + "\n")
    r.session(2)
    heads = [json.loads(x) for x in _lines(r.heads)]
    assert heads[1]["n"] == 1 and heads[1]["prev"] == digest(legacy)
    result = r.check()
    assert result.ok, result.problem
    assert result.unchained == 1 and result.chained == 2


def test_a_signer_that_cannot_read_its_last_head_starts_a_chain_that_verify_names(run, caplog):
    lines = _lines(run.heads)
    _write(run.heads, [*lines, b"{not a head"])
    assert HeadSigner(load_signing_key(run.key), run.heads, run.log.name)._n == 0
    assert "its last line is not a head: a new chain of heads starts" in caplog.text


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
    out = capsys.readouterr().out
    assert "ok: 15 records" in out
    assert "heads 1..4 expected and found in order; heads signed after head 4 and cut off with the log's tail are " \
           "seen only against a copy of the heads kept elsewhere" in out
    assert main(["audit", "verify", str(run.log), "--heads", str(run.heads)]) == 2
    assert "--heads needs --key" in capsys.readouterr().err
    _write(run.log, _lines(run.log)[:14])
    assert main(args) == 1
    assert "records 15..15 were cut from its end" in capsys.readouterr().err
