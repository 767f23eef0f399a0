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
     "state": "open" | "running" | "closed", "key": "<key id>", "n": 41,
     "prev": "<hex sha-256 of head 40>", "sig": "<base64>"}

``sig`` signs the line's other fields as :func:`payload` writes them; ``key``
is the first 16 hex digits of the SHA-256 of the raw public key. The heads are
chained too: ``n`` numbers them from 1, ``prev`` is the previous head's
:func:`digest` (:data:`GENESIS_HEAD` for the first), and the signer continues
the chain from the last head in its file when the router starts again.

:func:`check_heads` verifies each head's signature against the public key
given, the heads' own chain (a head removed from the middle or the start of
the file, or heads reordered, is named with the numbers it expected), then the
log against them: a head whose record the log does not hold as signed (the
tail was rewritten), one past the log's end (cut off), records after a
``closed`` head and before the next ``open`` one (written while the router was
stopped). Records after the last signed head of a running router are only
counted: no head covers them yet.

What a heads file proves, and what it cannot: against a copy kept where the
log's writer cannot write (another host, a collector fed by the
``kvrelay.audit.heads`` logger), any change to the log up to its last head. A
heads file kept beside the log, by someone who can write both, proves the log
against edits that leave the heads file alone, and its chain shows heads taken
out of its middle or start; but the last heads can be cut off with the log's
tail, and nothing in the file shows it. Only the copy elsewhere (or a head noted
elsewhere, ``--head``) does."""

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

_FIELDS = ("log", "seq", "head", "time", "state", "key", "n", "prev")
_UNCHAINED = _FIELDS[:6]
"""A head signed before heads were chained (no ``n``, ``prev``): read, never written."""
GENESIS_HEAD = "0" * 64
"""The ``prev`` of a chain's first head."""


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
    fields = _FIELDS if "n" in head else _UNCHAINED
    return json.dumps({k: head[k] for k in fields}, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def digest(head: dict) -> str:
    """What the next head's ``prev`` holds: SHA-256 of this head's payload and signature."""
    return hashlib.sha256(payload(head) + b"." + str(head["sig"]).encode("ascii", "replace")).hexdigest()


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
        self._n, self._prev = last_head(self.out)
        """The number and digest of the last head in the file: the chain goes on from it."""

    def sign(self, state: HeadState, seq: int, head: str, when: str) -> dict:
        """Signs (seq, head) at time ``when`` (ISO-8601) in ``state``, the next head of the chain; the
        signed head, also written out."""
        with self._lock:
            line = {"log": self.log_name, "seq": seq, "head": head, "time": when, "state": state.value,
                    "key": self.key_id, "n": self._n + 1, "prev": self._prev}
            line["sig"] = base64.b64encode(self._key.sign(payload(line))).decode("ascii")
            text = json.dumps(line, separators=(",", ":"), ensure_ascii=False)
            self._n, self._prev = self._n + 1, digest(line)
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


def last_head(path: Path) -> tuple[int, str]:
    """(n, digest) of the last head in the heads file at ``path``, to chain the next one to; (0,
    GENESIS_HEAD) when there is none. A file that cannot be read, or whose last line is not a head,
    is logged: the chain starts again, and `kvrelay audit verify` names where."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 64 * 1024))
            tail = [x for x in f.read().split(b"\n") if x.strip()]
    except FileNotFoundError:
        return 0, GENESIS_HEAD
    except OSError as exc:
        log.error("audit heads %s: cannot read its last head (%s): a new chain of heads starts", path,
                  exc.strerror or exc)
        return 0, GENESIS_HEAD
    if not tail:
        return 0, GENESIS_HEAD
    try:
        head = json.loads(tail[-1])
        return (int(head["n"]) if "n" in head else 0), digest(head)
    except (ValueError, KeyError, TypeError):
        log.error("audit heads %s: its last line is not a head: a new chain of heads starts", path)
        return 0, GENESIS_HEAD


@dataclass(slots=True, frozen=True)
class SignedHead:
    """One verified line of a heads file."""

    line: int
    seq: int
    head: str
    time: str
    state: HeadState
    n: int = 0
    """Its number in the chain of heads (0: signed before heads were chained)."""
    prev: str = ""
    """The previous head's digest, as it signed it."""
    digest: str = ""
    """Its own digest (what the next head's ``prev`` must hold)."""


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
            ok = (isinstance(head, dict) and all(k in head for k in (*_UNCHAINED, "sig"))
                  and type(head["seq"]) is int and head["seq"] >= 0 and head["state"] in {s.value for s in HeadState}
                  and ("n" not in head or (type(head["n"]) is int and head["n"] >= 1 and "prev" in head)))
        except ValueError:
            ok = False
        if not ok:
            raise HeadsError(f"{path} line {no} is not a signed head (log, seq, head, time, state, key, n, prev, "
                             "sig)")
        if head["key"] != kid:
            raise HeadsError(f"{path} line {no} was signed by key {head['key']}, not by the key given ({kid})")
        try:
            public.verify(base64.b64decode(str(head["sig"]), validate=True), payload(head))
        except (InvalidSignature, ValueError):
            raise HeadsError(f"{path} line {no}: its signature does not verify: the head was forged or "
                             f"altered") from None
        yield SignedHead(no, head["seq"], str(head["head"]), str(head["time"]), HeadState(head["state"]),
                         head.get("n", 0), str(head.get("prev", "")), digest(head))


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
    chained: int = 0
    """The number of the last head (heads 1..chained were expected, in order, and found)."""
    unchained: int = 0
    """Heads before the chain began (signed by a kvrelay that did not chain them: their removal is not seen)."""

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
    unchained = next((i for i, h in enumerate(heads) if h.n), len(heads))
    result = HeadsResult(chain, len(heads), covered=max(wanted, default=0), unchained=unchained,
                         chained=heads[-1].n if heads else 0)
    if chain.ok:
        result.problem = _heads_chain(heads, unchained) or _against(heads, links, last)
        result.uncovered = max(0, last - result.covered) if heads and heads[-1].state != HeadState.CLOSED else 0
    return result


def _heads_chain(heads: list[SignedHead], unchained: int) -> str | None:
    """The first break in the heads' own chain, naming the head expected; None when heads 1..n
    follow each other (after the ``unchained`` heads signed before chaining, if any)."""
    before: SignedHead | None = heads[unchained - 1] if unchained else None
    for h in heads[unchained:]:
        if not h.n:
            return f"heads line {h.line} is not chained (no n, prev) but follows chained heads: it was moved there"
        if before is None or not before.n:  # the chain's first head: it follows nothing, or unchained heads
            want_n, prevs, where = 1, {GENESIS_HEAD, before.digest if before else GENESIS_HEAD}, "first"
        else:
            want_n, prevs, where = before.n + 1, {before.digest}, f"after head {before.n} (heads line {before.line})"
        if h.n != want_n:
            gap = (f"heads {want_n}..{h.n - 1} were removed" if h.n > want_n else
                   "the heads were reordered, or a new chain began")
            return f"expected head {want_n} {where}, found head {h.n} at heads line {h.line}: {gap}"
        if h.prev not in prevs:
            return (f"head {h.n} (heads line {h.line}) does not follow the head before it in the file: heads were "
                    "replaced or spliced in from elsewhere")
        before = h
    return None


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


__all__ = ["GENESIS_HEAD", "HeadSigner", "HeadState", "HeadsError", "HeadsResult", "SignedHead", "check_heads",
           "digest", "generate_signing_key", "heads_path", "key_id", "last_head", "load_public_key",
           "load_signing_key", "payload", "read_heads"]
