"""Signed heads of the audit log: evidence another party keeps, against which
a rewritten or truncated tail is found.

The hash chain (router/governance/audit.py) finds an edited or removed record
in the middle of the log, but whoever can write the file can rewrite its tail
and re-chain it. So the router signs the chain's head with an Ed25519 key kept
apart from the log (``router.records.audit_signing_key``): when it opens the
log, at intervals while the head moves, and when it closes the log. Each
signed head is one JSON line appended to ``router.records.audit_heads`` (a
file for another party to keep: another host's mount, a collector) and logged
(logger ``kvrelay.audit.heads``) for a log shipper::

    {"log": "audit.jsonl", "seq": 812, "head": "<hex sha-256>", "time": "...Z",
     "state": "open" | "running" | "closed", "key": "<key id>", "sig": "<base64>"}

``sig`` signs the line's other fields as :func:`payload` writes them; ``key``
is the first 16 hex digits of the SHA-256 of the raw public key.

:func:`check_heads` verifies each head's signature against the public key
given, then the log against them: a head whose record the log does not hold
as signed (the tail was rewritten), one past the log's end (cut off), records
after a ``closed`` head and before the next ``open`` one (written while the
router was stopped). Records after the last signed head of a running router
are only counted: no head covers them yet."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import stat
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvrelay.router.governance.audit_chain import (
    GENESIS,
    Broken,
    Checker,
    VerifyResult,
    raw_lines,
    walk,
)

log = logging.getLogger(__name__)
heads_log = logging.getLogger("kvrelay.audit.heads")
"""Where each signed head is logged too, as ``audit head {json}`` at INFO (for a log shipper)."""

_FIELDS = ("log", "seq", "head", "time", "state", "key")


class HeadState(StrEnum):
    """When a head was signed."""

    OPEN = "open"
    """The router opened the log: the records before are all it found."""
    RUNNING = "running"
    """At an interval, while the router writes."""
    CLOSED = "closed"
    """The router closed the log: nothing may follow until it opens it again."""


class HeadsError(ValueError):
    """A key or a heads file that cannot be used: the message names the file (and line) and why."""


def key_id(public: Ed25519PublicKey) -> str:
    """First 16 hex digits of the SHA-256 of the raw 32-byte public key."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def payload(head: dict) -> bytes:
    """The bytes a head's ``sig`` signs: its other fields, in :data:`_FIELDS` order, compact JSON."""
    return json.dumps({k: head[k] for k in _FIELDS}, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def heads_path(audit_log: str | Path) -> Path:
    """The heads file's default: ``<audit_log>.heads`` beside the log."""
    p = Path(audit_log)
    return p.with_name(p.name + ".heads")


def generate_signing_key(path: Path) -> Path:
    """A new Ed25519 key at ``path`` (PEM PKCS#8, 0600, in a 0700 folder it creates)
    and its public key beside it (``<path>.pub``, PEM); the public key's path."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return write_public_key(key, path)


def write_public_key(key: Ed25519PrivateKey, path: Path) -> Path:
    """``<path>.pub``: the PEM public key of ``key`` (what `kvrelay audit verify --key` reads)."""
    pub = path.with_name(path.name + ".pub")
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return pub


def load_signing_key(path: str | Path) -> Ed25519PrivateKey:
    """The Ed25519 private key (PEM) at ``path``; HeadsError naming the file otherwise.
    A key others may read is used, with a warning."""
    path = Path(path)
    try:
        data, mode = path.read_bytes(), path.stat().st_mode
        key = serialization.load_pem_private_key(data, password=None)
    except OSError as exc:
        raise HeadsError(f"audit signing key {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError) as exc:
        raise HeadsError(f"audit signing key {path} is not a PEM private key without a password: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise HeadsError(f"audit signing key {path} is a {type(key).__name__.removeprefix('_')}, not an Ed25519 key")
    if stat.S_IMODE(mode) & 0o077:
        log.warning("audit signing key %s may be read by others (mode %o): chmod 600 it", path, stat.S_IMODE(mode))
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """The Ed25519 public key (PEM) at ``path``, or the public half of a private key file; HeadsError otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise HeadsError(f"{path}: {exc.strerror or exc}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = serialization.load_pem_private_key(data, password=None).public_key()
        except (ValueError, TypeError):
            raise HeadsError(f"{path} is not a PEM Ed25519 public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise HeadsError(f"{path} is a {type(key).__name__.removeprefix('_')}, not an Ed25519 public key")
    return key


class HeadSigner:
    """Signs the heads of one log and appends them to the heads file (and the ``kvrelay.audit.heads`` logger).
    A failed write is logged, never raised: the log itself goes on."""

    def __init__(self, key: Ed25519PrivateKey, out: str | Path, log_name: str) -> None:
        self._key, self.out, self.log_name = key, Path(out), log_name
        self.key_id = key_id(key.public_key())
        self.signed: tuple[int, str] | None = None
        """(seq, head) of the last head signed."""
        self._lock = threading.Lock()

    def sign(self, state: HeadState, seq: int, head: str, when: str) -> dict:
        """Signs (seq, head) at time ``when`` (ISO-8601) in ``state``; the signed head, also written out."""
        line = {"log": self.log_name, "seq": seq, "head": head, "time": when, "state": state.value,
                "key": self.key_id}
        line["sig"] = base64.b64encode(self._key.sign(payload(line))).decode("ascii")
        text = json.dumps(line, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            self.signed = (seq, head)
            try:
                fd = os.open(self.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, text.encode("utf-8") + b"\n")
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                log.error("audit heads %s: cannot append the %s head of seq %d: %s", self.out, state.value, seq,
                          exc.strerror or exc)
        heads_log.info("audit head %s", text)
        return line


@dataclass(slots=True, frozen=True)
class SignedHead:
    """One verified line of a heads file."""

    line: int
    seq: int
    head: str
    time: str
    state: HeadState


def read_heads(path: str | Path, public: Ed25519PublicKey) -> list[SignedHead]:
    """Every head of the heads file at ``path``, each signature checked against
    ``public``; HeadsError naming the line that is not a head or not signed by it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return list(_verified(path, f, public))
    except OSError as exc:
        raise HeadsError(f"{path}: {exc.strerror or exc}") from None


def _verified(path: Path, lines: Iterable[bytes], public: Ed25519PublicKey) -> Iterator[SignedHead]:
    kid = key_id(public)
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            head = json.loads(raw)
            ok = (isinstance(head, dict) and all(k in head for k in (*_FIELDS, "sig"))
                  and type(head["seq"]) is int and head["seq"] >= 0 and head["state"] in {s.value for s in HeadState})
        except ValueError:
            ok = False
        if not ok:
            raise HeadsError(f"{path} line {no} is not a signed head (log, seq, head, time, state, key, sig)")
        if head["key"] != kid:
            raise HeadsError(f"{path} line {no} was signed by key {head['key']}, not by the key given ({kid})")
        try:
            public.verify(base64.b64decode(str(head["sig"]), validate=True), payload(head))
        except (InvalidSignature, ValueError):
            raise HeadsError(f"{path} line {no}: its signature does not verify: the head was forged or "
                             f"altered") from None
        yield SignedHead(no, head["seq"], str(head["head"]), str(head["time"]), HeadState(head["state"]))


@dataclass(slots=True)
class HeadsResult:
    """The chain's own verdict, then the heads': ``chain.ok`` and ``problem`` None when both hold."""

    chain: VerifyResult
    heads: int
    """Signed heads checked."""
    problem: str | None = None
    covered: int = 0
    """The highest seq a signed head covers."""
    uncovered: int = 0
    """Records after the last signed head (a router still running; none when it closed the log)."""

    @property
    def ok(self) -> bool:
        return self.chain.ok and self.problem is None


def check_heads(log_path: str | Path, heads: list[SignedHead]) -> HeadsResult:
    """The log at ``log_path`` checked as :func:`verify` does, then against ``heads`` (verified lines of
    :func:`read_heads`): the first problem named. OSError if the log cannot be read."""
    wanted = {h.seq for h in heads}
    links: dict[int, tuple[str, int]] = {0: (GENESIS, 0)}
    checker = Checker()
    with open(log_path, "rb") as f:
        try:
            for line in walk(raw_lines(f)):
                checker.feed(line)
                if line.record["seq"] in wanted:
                    links[line.record["seq"]] = (line.link, line.no)
        except Broken as exc:
            return HeadsResult(checker.broken(exc), len(heads))
    chain = checker.result()
    last = checker.last.record["seq"] if checker.last else 0
    result = HeadsResult(chain, len(heads), covered=max(wanted, default=0))
    if chain.ok:
        result.problem = _against(heads, links, last)
        result.uncovered = max(0, last - result.covered) if heads and heads[-1].state != HeadState.CLOSED else 0
    return result


def _against(heads: list[SignedHead], links: dict[int, tuple[str, int]], last: int) -> str | None:
    """The first head the log does not agree with, named; None when all agree."""
    closed: SignedHead | None = None
    for h in heads:
        if h.seq > last:
            return (f"the log ends at seq {last}, but the head signed at {h.time} ({h.state.value}, heads line "
                    f"{h.line}) covers seq {h.seq}: records {last + 1}..{h.seq} were cut from its end")
        link, no = links[h.seq]
        if link != h.head:
            return (f"record seq {h.seq} (line {no}) is not the one signed at {h.time} (heads line {h.line}): the "
                    f"log was rewritten from there or before")
        if closed is not None and h.state == HeadState.OPEN and h.seq != closed.seq:
            return (f"records seq {closed.seq + 1}..{h.seq} were written while the router was stopped: after the "
                    f"head it signed closing the log at {closed.time}, before it opened the log at {h.time}")
        closed = h if h.state == HeadState.CLOSED else None
    if closed is not None and last > closed.seq:
        return (f"records seq {closed.seq + 1}..{last} follow the head the router signed when it closed the log "
                f"at {closed.time} (heads line {closed.line}): it wrote none of them")
    return None


__all__ = ["HeadSigner", "HeadState", "HeadsError", "HeadsResult", "SignedHead", "check_heads",
           "generate_signing_key", "heads_path", "key_id", "load_public_key", "load_signing_key", "payload",
           "read_heads"]
