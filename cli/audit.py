"""`kvrelay audit` commands: verify the router's hash-chained audit log
(router/governance/audit.py), and query its records by tenant, site, time and kind.

``kvrelay audit verify FILE...`` prints ``ok: N records, head <hash>`` for
each log; note the head somewhere else, and ``--head`` later finds the log's
end edited or cut off since. ``--heads FILE --key PUB`` checks the log against
the heads the router signed (router/governance/audit_heads.py): a tail
rewritten, cut off, or appended to while the router was stopped. With several routers each keeps its own chain
(``audit.<router>.jsonl`` beside the others under `kvrelay serve`): verify
takes them all and names the file and record of each problem. ``kvrelay audit
query`` reads ``<cache dir>/audit.jsonl`` and every router's beside it (where
``kvrelay serve`` keeps them) unless ``--file`` names others; their records
come merged in time order."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvrelay.cli.common import table
from kvrelay.router.core.records import RecordKind
from kvrelay.router.governance.audit import parse_time, query, verify
from kvrelay.router.governance.audit_heads import (
    HeadsResult,
    SignedHead,
    check_heads,
    load_public_key,
    read_heads,
)

AUDIT_FILE = "audit.jsonl"
"""The audit log's name in the cache folder (``kvrelay serve``'s default ``router.records.audit_log``)."""
_HEAD = re.compile(r"[0-9a-fA-F]{64}")


def cmd_audit_verify(args: argparse.Namespace) -> int:
    """0 and ``ok: ...`` when every chain holds (and agrees with its signed heads);
    1 and each broken chain's first problem otherwise."""
    if args.head is not None and not _HEAD.fullmatch(args.head):
        raise ValueError(f"--head: {args.head!r} is not a SHA-256 (64 hex digits, as `kvrelay audit verify` prints)")
    if args.head is not None and len(args.file) > 1:
        raise ValueError("--head is one log's head: give it with that log alone")
    heads = _signed_heads(args)
    failed = 0
    for i, path in enumerate(args.file):
        name = path + ": " if len(args.file) > 1 else ""
        try:
            if heads is not None:
                failed += _verify_signed(path, name, heads[i])
                continue
            result = verify(path, head=args.head.lower() if args.head else None)
        except OSError as exc:
            raise OSError(f"{path}: {exc.strerror or exc}") from None
        if result.ok:
            print(f"{name}ok: {result.records} records, head {result.head}")
        else:
            failed += 1
            print(f"kvrelay: {path}: {result.problem}", file=sys.stderr)
    return 1 if failed else 0


def _signed_heads(args: argparse.Namespace) -> list[list[SignedHead]] | None:
    """Each log's signed heads (``--heads``, in the order of the logs), their signatures checked; None without."""
    if not args.heads:
        if args.key:
            raise ValueError("--key is the key of signed heads: give --heads too")
        return None
    if len(args.heads) != len(args.file):
        raise ValueError(f"--heads: {len(args.heads)} heads files for {len(args.file)} logs: give one per log, "
                         "in the same order")
    if not args.key:
        raise ValueError("--heads needs --key: the public key the router signs with (router.records."
                         "audit_signing_key's, e.g. keys/audit-signing.key.pub beside kvrelay serve's log)")
    key = load_public_key(args.key)
    return [read_heads(h, key) for h in args.heads]


def _verify_signed(path: str, name: str, heads: list[SignedHead]) -> int:
    """One log against its signed heads: prints the verdict; 1 if it fails."""
    result = check_heads(path, heads)
    if not result.chain.ok:
        print(f"kvrelay: {path}: {result.chain.problem}", file=sys.stderr)
        return 1
    if result.problem is not None:
        print(f"kvrelay: {path}: {result.problem}", file=sys.stderr)
        return 1
    tail = f"; {result.uncovered} records after it not yet covered" if result.uncovered else ""
    print(f"{name}ok: {result.chain.records} records, head {result.chain.head}; {result.heads} signed heads agree "
          f"(up to seq {result.covered}{tail}); {_expected(result)}")
    return 0


def _expected(result: HeadsResult) -> str:
    """Which heads verify expected, and what the file cannot show (heads cut off after its last)."""
    old = (f"{result.unchained} heads signed before heads were chained (one taken out of those is not seen), then "
           if result.unchained else "")
    if not result.chained:
        return old.removesuffix(", then ") or "no heads"
    return (f"{old}heads 1..{result.chained} expected and found in order; heads signed after head {result.chained} "
            f"and cut off with the log's tail are seen only against a copy of the heads kept elsewhere")


def _since(text: str):
    try:
        return parse_time(text)
    except ValueError:
        raise ValueError(f"--since: {text!r} is not an ISO-8601 time (e.g. 2026-12-01, 2026-12-01T21:50:00Z); "
                         "a time without a zone is UTC") from None


def _row(r: dict) -> tuple[str, ...]:
    """One record as table columns: time, kind, tenant, who/what, sites, tokens, outcome."""
    def get(*keys: str) -> str:
        return next((str(r[k]) for k in keys if r.get(k) not in (None, "")), "-")
    sites = "->".join(str(r[k]) for k in ("prefill_site", "decode_site") if r.get(k)) or get("site")
    tokens = "-"
    if "prompt_tokens" in r or "completion_tokens" in r:
        tokens = f"{r.get('prompt_tokens', 0)}+{r.get('completion_tokens', 0)}"
    return (get("time"), get("kind"), get("tenant"), get("request_id", "operator", "job", "worker_id", "worker"),
            sites, tokens, get("outcome", "status", "action"))


def cmd_audit_query(args: argparse.Namespace) -> int:
    """The matching records: a table, or with ``--json`` one JSON object per line."""
    since = _since(args.since) if args.since else None
    paths = [Path(f) for f in args.file] if args.file else _local_logs(args.cache_dir)
    for path in paths:
        if not path.is_file():
            raise OSError(f"no audit log at {path}" + ("" if args.file else " (--file names another)"))
    records = _merged([list(query(p, tenant=args.tenant, site=args.site, since=since, kind=args.kind))
                       for p in paths])
    if args.json:
        for r in records:
            print(json.dumps(r, ensure_ascii=False))
        return 0
    rows = [_row(r) for r in records]
    table([("TIME", "KIND", "TENANT", "REQUEST/OPERATOR", "SITES", "TOKENS", "OUTCOME"), *rows])
    return 0


def _local_logs(cache_dir: Path) -> list[Path]:
    """`kvrelay serve`'s logs: the one router's, and each router's of a deployment with several."""
    logs = sorted(cache_dir.glob("audit.*.jsonl"))
    single = cache_dir / AUDIT_FILE
    return [single, *logs] if single.is_file() or not logs else logs


def _merged(logs: list[list[dict]]) -> list[dict]:
    """Records of several logs in time order (each log's own order kept among equal times)."""
    if len(logs) == 1:
        return logs[0]
    return sorted((r for log in logs for r in log), key=lambda r: str(r.get("time", "")))


def add_parsers(sub) -> None:
    audit = sub.add_parser("audit", help="the router's audit log: verify its chain, query its records")
    cmds = audit.add_subparsers(dest="audit_command", required=True)
    v = cmds.add_parser("verify", help="check the hash chain; prints the head, or the first problem (exit 1)")
    v.add_argument("file", nargs="+", help="the audit log (JSONL); with several routers, each router's")
    v.add_argument("--head", help="a head printed earlier: the log must still contain it (finds its end "
                                  "edited or cut off)")
    v.add_argument("--heads", action="append", help="the heads the router signed (router.records.audit_heads; "
                                                    "again for each log, in order): finds the log's tail "
                                                    "rewritten, cut off or appended to while it was closed")
    v.add_argument("--key", help="the Ed25519 public key (PEM) the heads were signed with")
    v.set_defaults(func=cmd_audit_verify)
    q = cmds.add_parser("query", help="records by tenant, site, time and kind")
    q.add_argument("--file", action="append", help=f"an audit log, again for each router's (default: <cache dir>/"
                                                   f"{AUDIT_FILE} and audit.<router>.jsonl, kvrelay serve's)")
    q.add_argument("--tenant", help="records of this tenant")
    q.add_argument("--site", help="records naming this site (prefill, decode or the record's own)")
    q.add_argument("--since", help="records at or after this ISO-8601 time (UTC unless it says)")
    q.add_argument("--kind", choices=[k.value for k in RecordKind], help="records of this kind")
    q.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    q.set_defaults(func=cmd_audit_query)
