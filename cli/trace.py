"""`kvrelay trace REQUEST_ID`: one request's spans from the JSONL files the
processes write (``telemetry.traces: file``; runtime/tracing.py gives the
format), as a terminal waterfall or as JSON. The rendering is pure
(:func:`tree_order`, :func:`waterfall`) so tests check it line by line."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from kvrelay.cli.watch import human_bytes
from kvrelay.runtime.tracing import read_spans

DEFAULT_DIR = Path("kvrelay-traces")
"""Where the processes write their span files by default (``telemetry.file``)."""
REQUEST_ID = "kvrelay.request_id"
"""The attribute naming the client's request id (on the router's root span)."""
KEY_ATTRIBUTES = ("kvrelay.site", "kvrelay.worker", "kvrelay.link", "kvrelay.transport", "kvrelay.kv.bytes")
"""Attributes shown beside a span's name (``kvrelay.`` left off)."""
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_REQUIRED = ("trace_id", "span_id", "name", "start_unix_nano")
_LEFT = 22
"""Width of the offset and duration columns, their gaps included."""


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with control characters (terminal escapes from a span file) shown as ``?``."""
    return _CONTROL.sub("?", text)


def span_files(folder: Path | None, files: Sequence[Path] | None) -> list[Path]:
    """The files to read: ``files`` as given, else every ``*.jsonl`` in ``folder``."""
    if files:
        return list(files)
    folder = folder or DEFAULT_DIR
    return sorted(folder.glob("*.jsonl")) if folder.is_dir() else []


def load_spans(paths: Sequence[Path]) -> list[dict]:
    """Every span in ``paths``, each once (ValueError naming the file at a bad line or record)."""
    seen: dict[tuple[str, str], dict] = {}
    for path in paths:
        for i, rec in enumerate(read_spans([path])):
            if not isinstance(rec, dict) or any(rec.get(k) is None for k in _REQUIRED):
                raise ValueError(f"{path}: record {i + 1} is not a span (it needs {', '.join(_REQUIRED)})")
            seen.setdefault((rec["trace_id"], rec["span_id"]), rec)
    return list(seen.values())


def _end(span: dict) -> int:
    return span.get("end_unix_nano") or span["start_unix_nano"]


def find_trace(spans: Sequence[dict], request_id: str) -> tuple[str | None, int]:
    """The trace id of ``request_id`` (a span's ``kvrelay.request_id``, else a
    32-hex trace id), the latest when it names several; and how many traces
    it names (0: none)."""
    starts: dict[str, int] = {}
    for s in spans:
        if (s.get("attributes") or {}).get(REQUEST_ID) == request_id:
            starts[s["trace_id"]] = min(starts.get(s["trace_id"], s["start_unix_nano"]), s["start_unix_nano"])
    if starts:
        return max(starts, key=starts.__getitem__), len(starts)
    tid = request_id.strip().lower()
    if _TRACE_ID.fullmatch(tid) and any(s["trace_id"] == tid for s in spans):
        return tid, 1
    return None, 0


def tree_order(spans: Sequence[dict]) -> list[tuple[int, dict]]:
    """(depth, span) with each span's children right below it, by start time;
    a span whose parent is not among ``spans`` is a root."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict]] = {}
    for s in spans:
        parent = s.get("parent_span_id")
        children.setdefault(parent if parent in ids else None, []).append(s)
    for kids in children.values():
        kids.sort(key=lambda s: (s["start_unix_nano"], _end(s), s["name"]))
    out: list[tuple[int, dict]] = []
    done: set[str] = set()
    stack = [(0, s) for s in reversed(children.get(None, []))]
    while stack:
        depth, span = stack.pop()
        if span["span_id"] in done:
            continue
        done.add(span["span_id"])
        out.append((depth, span))
        stack.extend((depth + 1, c) for c in reversed(children.get(span["span_id"], [])))
    # spans in a parent cycle (a corrupt file) reach no root: shown as roots, not dropped
    out.extend((0, s) for s in sorted(spans, key=lambda s: s["start_unix_nano"]) if s["span_id"] not in done)
    return out


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f}"


def key_attributes(attributes: dict) -> str:
    """``site=toronto worker=toronto/decode/0 kv.bytes=1.2 MB``: the attributes of KEY_ATTRIBUTES present."""
    parts = []
    for key in KEY_ATTRIBUTES:
        value = attributes.get(key)
        if value is None or value == "":
            continue
        if key == "kvrelay.kv.bytes" and isinstance(value, (int, float)):
            value = human_bytes(value)
        parts.append(f"{key.removeprefix('kvrelay.')}={value}")
    return " ".join(parts)


def span_label(span: dict, depth: int) -> str:
    """Indented name, service, key attributes, and the error when it failed."""
    label = "  " * depth + span["name"]
    if span.get("service"):
        label += f"  [{span['service']}]"
    attrs = key_attributes(span.get("attributes") or {})
    if attrs:
        label += f"  {attrs}"
    if span.get("status") == "ERROR":
        label += f"  ERROR: {span.get('status_message') or '(no message)'}"
    return label


def bar(start: int, end: int, t0: int, total: int, width: int, fill: str) -> str:
    """``width`` cells with ``fill`` from ``start`` to ``end`` (ns; the trace spans ``t0`` .. ``t0+total``)."""
    scale = width / total if total > 0 else 0.0
    a = min(width - 1, int((start - t0) * scale))
    b = max(a + 1, min(width, round((end - t0) * scale)))
    return " " * a + fill * (b - a) + " " * (width - b)


def waterfall(spans: Sequence[dict], width: int = 100, fill: str = "█") -> list[str]:
    """One trace as lines: a header, then per span (tree order) its offset from
    the trace start and duration in ms, a bar, its label; below it its events
    (consecutive ones of the same name on one line: ``· layer ×30 +43.9 … +300.7 ms``)."""
    ordered = tree_order(spans)
    t0 = min(s["start_unix_nano"] for s in spans)
    total = max(_end(s) for s in spans) - t0
    labels = [span_label(s, d) for d, s in ordered]
    bar_w = max(10, width - _LEFT - min(max(map(len, labels)), width // 2) - 2)
    services = sorted({s.get("service") or "?" for s in spans})
    lines = [f"trace {spans[0]['trace_id']}: {len(spans)} spans, {_ms(total)} ms, {', '.join(services)}",
             f"{'OFFSET MS':>10}  {'DUR MS':>8}  {'':{bar_w}}  SPAN"]
    for (depth, span), label in zip(ordered, labels):
        start, end = span["start_unix_nano"], _end(span)
        lines.append(f"{'+' + _ms(start - t0):>10}  {_ms(end - start):>8}  "
                     f"{bar(start, end, t0, total, bar_w, fill)}  {label}")
        for name, first, last, count in event_runs(span.get("events") or [], start):
            mark = bar(first, last, t0, total, bar_w, "|")
            when = f"+{_ms(first - t0)} ms" if count == 1 else f"×{count} +{_ms(first - t0)} … +{_ms(last - t0)} ms"
            lines.append(f"{'':>10}  {'':>8}  {mark}  {'  ' * (depth + 1)}· {name} {when}")
    return lines


def event_runs(events: Sequence[dict], default_ns: int) -> list[tuple[str, int, int, int]]:
    """(name, first ns, last ns, count) per run of consecutive same-named events,
    by time; an event without a time is at ``default_ns`` (its span's start)."""
    runs: list[tuple[str, int, int, int]] = []
    timed = sorted(((e.get("time_unix_nano") or default_ns, e.get("name", "?")) for e in events),
                   key=lambda t: t[0])
    for at, name in timed:
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], at, runs[-1][3] + 1)
        else:
            runs.append((name, at, at, 1))
    return runs


def json_spans(spans: Sequence[dict]) -> list[dict]:
    """The spans in tree order, each with its ``depth``."""
    return [{**s, "depth": d} for d, s in tree_order(spans)]


def _fill() -> str:
    """The bar's character: a block where stdout can encode it, else ``#``."""
    try:
        "█".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "#"
    return "█"


def cmd_trace(args: argparse.Namespace) -> int:
    """Finds the request's trace in the span files and shows it."""
    files = span_files(args.dir, args.file)
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        where = ", ".join(missing) if missing else f"{args.dir or DEFAULT_DIR}/*.jsonl"
        print(f"kvrelay: no span files: {where} (processes write them with telemetry.traces: file; "
              "pass --dir or --file)", file=sys.stderr)
        return 2
    try:
        spans = load_spans(files)
    except ValueError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    trace_id, matches = find_trace(spans, args.request_id)
    if trace_id is None:
        traces = len({s["trace_id"] for s in spans})
        print(f"kvrelay: no trace of request {args.request_id!r} in {traces} traces in {len(files)} files "
              f"({', '.join(map(str, files))})", file=sys.stderr)
        return 1
    if matches > 1:
        print(f"kvrelay: request {args.request_id!r} has {matches} traces; showing the latest ({trace_id})",
              file=sys.stderr)
    mine = [s for s in spans if s["trace_id"] == trace_id]
    if args.json:
        print(json.dumps(json_spans(mine), indent=2))
        return 0
    width = shutil.get_terminal_size((100, 24)).columns
    print("\n".join(printable(line) for line in waterfall(mine, width, _fill())))
    return 0


def add_parsers(sub) -> None:
    tr = sub.add_parser("trace", help="one request's spans across router and workers, as a waterfall "
                                      "(from telemetry.traces: file)")
    tr.add_argument("request_id", metavar="REQUEST_ID",
                    help="the client's request id (span attribute kvrelay.request_id) or a 32-hex trace id")
    src = tr.add_mutually_exclusive_group()
    src.add_argument("--dir", type=Path, help=f"read every *.jsonl here (default: {DEFAULT_DIR})")
    src.add_argument("--file", type=Path, action="append", help="read this span file (repeatable)")
    tr.add_argument("--json", action="store_true", help="print the trace's spans as JSON, in tree order, with depth")
    tr.set_defaults(func=cmd_trace)
