"""`kvrelay audit` commands: verify the router's hash-chained audit log
(router/governance/audit.py), and query its records by tenant, site, time and kind.

``kvrelay audit verify FILE`` prints ``ok: N records, head <hash>``; note
the head somewhere else, and ``--head`` later finds the log's end edited or
cut off since. ``kvrelay audit query`` reads ``<cache dir>/audit.jsonl``
(where ``kvrelay serve`` keeps it) unless ``--file`` names another."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvrelay.cli.common import table
from kvrelay.router.core.records import RecordKind
from kvrelay.router.governance.audit import parse_time, query, verify

AUDIT_FILE = "audit.jsonl"
"""The audit log's name in the cache folder (``kvrelay serve``'s default ``router.records.audit_log``)."""
_HEAD = re.compile(r"[0-9a-fA-F]{64}")


def cmd_audit_verify(args: argparse.Namespace) -> int:
    """0 and ``ok: ...`` when the chain holds; 1 and its first problem otherwise."""
    if args.head is not None and not _HEAD.fullmatch(args.head):
        raise ValueError(f"--head: {args.head!r} is not a SHA-256 (64 hex digits, as `kvrelay audit verify` prints)")
    try:
        result = verify(args.file, head=args.head.lower() if args.head else None)
    except OSError as exc:
        raise OSError(f"{args.file}: {exc.strerror or exc}") from None
    if result.ok:
        print(f"ok: {result.records} records, head {result.head}")
        return 0
    print(f"kvrelay: {args.file}: {result.problem}", file=sys.stderr)
    return 1


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
    path = Path(args.file) if args.file else args.cache_dir / AUDIT_FILE
    if not path.is_file():
        raise OSError(f"no audit log at {path}" + ("" if args.file else " (--file names another)"))
    records = query(path, tenant=args.tenant, site=args.site, since=since, kind=args.kind)
    if args.json:
        for r in records:
            print(json.dumps(r, ensure_ascii=False))
        return 0
    rows = [_row(r) for r in records]
    table([("TIME", "KIND", "TENANT", "REQUEST/OPERATOR", "SITES", "TOKENS", "OUTCOME"), *rows])
    return 0


def add_parsers(sub) -> None:
    audit = sub.add_parser("audit", help="the router's audit log: verify its chain, query its records")
    cmds = audit.add_subparsers(dest="audit_command", required=True)
    v = cmds.add_parser("verify", help="check the hash chain; prints the head, or the first problem (exit 1)")
    v.add_argument("file", help="the audit log (JSONL)")
    v.add_argument("--head", help="a head printed earlier: the log must still contain it (finds its end "
                                  "edited or cut off)")
    v.set_defaults(func=cmd_audit_verify)
    q = cmds.add_parser("query", help="records by tenant, site, time and kind")
    q.add_argument("--file", help=f"the audit log (default: <cache dir>/{AUDIT_FILE}, kvrelay serve's)")
    q.add_argument("--tenant", help="records of this tenant")
    q.add_argument("--site", help="records naming this site (prefill, decode or the record's own)")
    q.add_argument("--since", help="records at or after this ISO-8601 time (UTC unless it says)")
    q.add_argument("--kind", choices=[k.value for k in RecordKind], help="records of this kind")
    q.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    q.set_defaults(func=cmd_audit_query)
