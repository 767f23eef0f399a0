"""`kvrelay usage`: requests, tokens, KV bytes and worker-seconds per
tenant, site and link (or any grouping of tenant, site, link, role,
worker), the sum of the workers' own counters as the router's ledger
recorded them per minute (``Admin.Usage``; operators only)."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time

import grpc

from kvrelay.cli.admin import admin_call, operator_flags, tenant_reader_flag
from kvrelay.cli.common import grpc_error, table
from kvrelay.v1 import admin_pb2 as apb

GROUP_FIELDS = ("tenant", "site", "link", "role", "worker")
COUNT_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "kv_bytes", "prefill_worker_s",
                "decode_worker_s")
"""The fields of ``kvrelay.v1.UsageRow``: the JSON output's names."""
_RELATIVE = re.compile(r"-?\s*(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float) -> float:
    """Unix time of ``--since``: ``-1h``, ``30m``, ``2d`` (before ``now``), an
    ISO 8601 time (without an offset: local time), or ``0`` (since records
    began). ValueError naming the form otherwise."""
    text = text.strip()
    if text in ("", "0"):
        return 0.0
    m = _RELATIVE.fullmatch(text)
    if m:
        return max(0.0, now - float(m.group(1)) * _UNIT_S[m.group(2)])
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"--since {text!r}: give a duration back from now (-1h, 30m, 2d, 1w) "
                         "or an ISO 8601 time (2026-12-01T09:00, 2026-12-01T09:00+00:00)") from None


def row_dict(row: apb.UsageRow) -> dict:
    """One row with UsageRow's field names (every field, zeros included)."""
    return {f: getattr(row, f) for f in (*GROUP_FIELDS, *COUNT_FIELDS)}


def totals(rows: list[dict]) -> dict:
    """The sums of every count over ``rows``."""
    return {f: sum(r[f] for r in rows) for f in COUNT_FIELDS}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds") if t else "-"


def show_table(resp: apb.UsageResponse, by: list[str]) -> None:
    rows = [row_dict(r) for r in resp.rows]
    head = (*(g.upper() for g in by), "REQUESTS", "PROMPT", "COMPLETION", "CACHED", "KV BYTES", "PREFILL S",
            "DECODE S")

    def cells(r: dict, groups: tuple[str, ...]) -> tuple[str, ...]:
        return (*groups, str(r["requests"]), str(r["prompt_tokens"]), str(r["completion_tokens"]),
                str(r["cached_tokens"]), str(r["kv_bytes"]), f"{r['prefill_worker_s']:.3f}",
                f"{r['decode_worker_s']:.3f}")
    body = [cells(r, tuple(r[g] or "-" for g in by)) for r in rows]
    total = cells(totals(rows), ("TOTAL", *("" for _ in by[1:])))
    table([head, *body, total])
    print(f"\n(minutes from {_iso(resp.since_unix)} to the heartbeat of {_iso(resp.until_unix)}; "
          "the sum of the workers' own counters; link \"-\": colocated, no KV moved)")


def cmd_usage(args: argparse.Namespace) -> int:
    try:
        since = parse_since(args.since, time.time())
    except ValueError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    by = [b.strip() for b in args.by.split(",") if b.strip()]
    try:
        resp = admin_call(args, "Usage", apb.UsageRequest(since_unix=since, by=by, tenant=args.tenant))
    except grpc.RpcError as exc:
        return grpc_error(exc)
    by = by or ["tenant", "site", "link"]
    if args.json:
        rows = [row_dict(r) for r in resp.rows]
        print(json.dumps({"since_unix": resp.since_unix, "until_unix": resp.until_unix, "by": by, "rows": rows,
                          "total": totals(rows)}, indent=2))
    else:
        show_table(resp, by)
    return 0


def add_parsers(sub) -> None:
    us = sub.add_parser("usage", help="requests, tokens, KV bytes and worker-seconds per tenant, site and link, "
                                      "from the workers' own counters (operators; a tenant: --as-tenant)")
    us.add_argument("--since", default="0", help="from this time on: 1h (ago), 30m, 2d, --since=-1h, or an ISO "
                                                 "8601 time (default: since records began)")
    us.add_argument("--by", default="tenant,site,link",
                    help="group by these, comma-separated, of: tenant, site, link, role, worker "
                         "(default: %(default)s)")
    us.add_argument("--tenant", default="", help="only this tenant")
    us.add_argument("--json", action="store_true", help="JSON with UsageRow's field names, and the totals")
    operator_flags(us)
    tenant_reader_flag(us, "its usage")
    us.set_defaults(func=cmd_usage)
