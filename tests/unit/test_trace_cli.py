"""`kvrelay trace`: span files written by the real tracer of two processes
(router and a decode worker), read back as one request's waterfall."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.cli.main import main
from kvrelay.cli.trace import bar, json_spans, tree_order, waterfall
from kvrelay.runtime.config import TelemetrySection
from kvrelay.runtime.tracing import Tracing, remote_parent, traceparent, within

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
CLIENT_PARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
"""A client's own span: the router's root names it as parent; it is in no file."""


def _tracers(folder: Path) -> tuple[Tracing, Tracing]:
    section = TelemetrySection(traces="file", file=str(folder / "{process}.jsonl"))
    return (Tracing(section, "kvrelay-router", "router"),
            Tracing(section, "kvrelay-decode", "toronto-decode-0"))


def _request(router: Tracing, decode: Tracing, request_id: str, t0: int, client: str | None = None) -> str:
    """One request's spans across both processes; returns its trace id."""
    root = router.start("kvrelay.request", parent=remote_parent(client), start_ns=t0,
                        attributes={"kvrelay.request_id": request_id, "kvrelay.site": "toronto"})
    place = router.start("kvrelay.place", parent=within(root), start_ns=t0 + 1 * MS)
    place.end(end_time=t0 + 2 * MS)
    dec = decode.start("kvrelay.decode", parent=remote_parent(traceparent(root)), start_ns=t0 + 3 * MS,
                       attributes={"kvrelay.worker": "toronto/decode/0", "kvrelay.link": "local",
                                   "kvrelay.transport": "tcp", "kvrelay.kv.bytes": 1_234_567})
    recv = decode.start("kvrelay.kv.receive", parent=within(dec), start_ns=t0 + 4 * MS)
    recv.end(end_time=t0 + 50 * MS)
    dec.add_event("first_token", timestamp=t0 + 412_300_000)
    dec.end(end_time=t0 + 500 * MS)
    root.end(end_time=t0 + 510 * MS)
    return format(root.get_span_context().trace_id, "032x")


@pytest.fixture
def traces(tmp_path: Path) -> dict:
    """Two requests (req-42 with a client parent, req-7) in router.jsonl and toronto-decode-0.jsonl."""
    folder = tmp_path / "kvrelay-traces"
    router, decode = _tracers(folder)
    tid = _request(router, decode, "req-42", T0, CLIENT_PARENT)
    other = _request(router, decode, "req-7", T0 + 10_000 * MS)
    router.shutdown()
    decode.shutdown()
    return {"dir": folder, "trace_id": tid, "other": other}


def _span_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "kvrelay." in ln and "·" not in ln]


def test_waterfall_of_a_request_across_processes(traces, capsys):
    assert main(["trace", "req-42", "--dir", str(traces["dir"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trace {traces['trace_id']}: 4 spans, 510.0 ms, kvrelay-decode, kvrelay-router")
    lines = _span_lines(out)
    names = [ln.split("  ")[-1] for ln in lines]
    assert len(lines) == 4, out
    order = ["kvrelay.request  [kvrelay-router]", "  kvrelay.place  [kvrelay-router]",
             "  kvrelay.decode  [kvrelay-decode]", "    kvrelay.kv.receive  [kvrelay-decode]"]
    for line, label in zip(lines, order):
        assert label in line, (label, line)
    assert names  # labels end each line
    assert lines[0].split()[:2] == ["+0.0", "510.0"] and "site=toronto" in lines[0]
    assert lines[2].split()[:2] == ["+3.0", "497.0"]
    assert "worker=toronto/decode/0 link=local transport=tcp kv.bytes=1.2 MB" in lines[2]
    rows = out.splitlines()
    event = rows.index(lines[2]) + 1
    assert rows[event].rstrip().endswith("    · first_token +412.3 ms")
    assert rows[event + 1] == lines[3]  # the event sits under its span, before the span's children
    assert traces["other"] not in out


def test_a_trace_id_and_repeated_file_flags(traces, capsys):
    files = sorted(traces["dir"].glob("*.jsonl"))
    args = ["trace", traces["other"].upper()]
    for f in files:
        args += ["--file", str(f)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trace {traces['other']}: 4 spans")
    assert traces["trace_id"] not in out


def test_json_is_the_tree_with_depths(traces, capsys):
    assert main(["trace", "req-42", "--dir", str(traces["dir"]), "--json"]) == 0
    spans = json.loads(capsys.readouterr().out)
    assert [(s["name"], s["depth"]) for s in spans] == [
        ("kvrelay.request", 0), ("kvrelay.place", 1), ("kvrelay.decode", 1), ("kvrelay.kv.receive", 2)]
    root = spans[0]
    assert root["parent_span_id"] == "cd" * 8 and root["attributes"]["kvrelay.request_id"] == "req-42"
    assert spans[2]["events"][0]["name"] == "first_token"


def test_not_found_names_the_request_and_what_was_searched(traces, capsys):
    assert main(["trace", "req-nope", "--dir", str(traces["dir"])]) == 1
    err = capsys.readouterr().err
    assert "'req-nope'" in err and "2 traces in 2 files" in err


def test_a_torn_last_line_is_skipped_and_a_bad_line_is_an_error(traces, capsys):
    router = traces["dir"] / "router.jsonl"
    with router.open("a") as f:
        f.write('{"trace_id": "' + traces["trace_id"][:10])  # a process killed mid-write
    assert main(["trace", "req-42", "--dir", str(traces["dir"])]) == 0
    assert len(_span_lines(capsys.readouterr().out)) == 4
    router.write_text("not json\n" + router.read_text())
    assert main(["trace", "req-42", "--dir", str(traces["dir"])]) == 2
    assert f"{router}:1: not a span record" in capsys.readouterr().err


def test_no_span_files(tmp_path, capsys):
    assert main(["trace", "req-42", "--dir", str(tmp_path)]) == 2
    assert "no span files" in capsys.readouterr().err
    assert main(["trace", "req-42", "--file", str(tmp_path / "gone.jsonl")]) == 2
    assert "gone.jsonl" in capsys.readouterr().err


def _span(sid: str, parent: str | None, start_ms: float, end_ms: float, name: str | None = None) -> dict:
    return {"trace_id": "1" * 32, "span_id": sid, "parent_span_id": parent, "name": name or sid,
            "service": "kvrelay-router", "start_unix_nano": int(start_ms * MS), "end_unix_nano": int(end_ms * MS),
            "attributes": {}, "events": [], "status": "UNSET"}


def test_tree_order_roots_orphans_and_cycles():
    spans = [_span("b", "a", 5, 6), _span("a", None, 0, 10), _span("c", "a", 1, 2), _span("d", "gone", 2, 3),
             _span("x", "y", 7, 8), _span("y", "x", 7, 9)]
    got = [(d, s["span_id"]) for d, s in tree_order(spans)]
    assert got[:4] == [(0, "a"), (1, "c"), (1, "b"), (0, "d")]
    assert sorted(got[4:]) == [(0, "x"), (0, "y")]  # a corrupt parent cycle is shown, not dropped


def test_bars_scale_to_the_width():
    assert bar(0, 50, 0, 100, 10, "#") == "#####     "
    assert bar(50, 100, 0, 100, 10, "#") == "     #####"
    assert bar(100, 100, 0, 100, 10, "|") == "         |"  # an instant still shows
    lines = waterfall([_span("a", None, 0, 100), _span("b", "a", 50, 100)], width=60, fill="#")
    width = len(lines[2][22:].split(" ")[0])  # the root's bar fills the whole column
    assert width == 60 - 22 - len("  b  [kvrelay-router]") - 2
    assert lines[3][22:22 + width] == " " * 7 + "#" * 8  # from cell 7.5 (floor) to the end


def test_a_run_of_same_named_events_is_one_line():
    send = _span("s", None, 0, 400, name="kvrelay.kv.send")
    layers = [{"name": "layer", "time_unix_nano": int((43.9 + i * (300.7 - 43.9) / 29) * MS)} for i in range(30)]
    send["events"] = [*reversed(layers), {"name": "done", "time_unix_nano": 350 * MS},
                      {"name": "layer", "time_unix_nano": 360 * MS}]
    lines = waterfall([send], width=100, fill="#")
    events = [ln[ln.index("·"):] for ln in lines if "·" in ln]
    assert events == ["· layer ×30 +43.9 … +300.7 ms", "· done +350.0 ms", "· layer +360.0 ms"]
    run = next(ln for ln in lines if "×30" in ln)
    assert run[22:].split()[0] == "|" * len(run[22:].split()[0]) and len(run[22:].split()[0]) > 1  # a range
    assert len(json_spans([send])[0]["events"]) == 32  # --json keeps every event


def test_hostile_span_files_are_refused_or_shown_harmlessly(tmp_path, capsys):
    """A record of the wrong shape is refused naming its line; terminal escapes in names are not printed."""
    from kvrelay.cli.main import main as kvrelay_main
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text('{"trace_id": "a", "span_id": [1], "name": "n", "start_unix_nano": 1}\n'
                                 '{"trace_id": "a", "span_id": "b", "name": "n", "start_unix_nano": 1}\n')
    assert kvrelay_main(["trace", "whatever", "--dir", str(bad)]) == 2
    assert "x.jsonl:1" in capsys.readouterr().err
    esc = tmp_path / "esc"
    esc.mkdir()
    rec = {"trace_id": "1" * 32, "span_id": "2" * 16, "parent_span_id": None, "name": "evil\x1b[2Jname",
           "start_unix_nano": 1, "end_unix_nano": 2, "attributes": {"kvrelay.request_id": "r"}, "events": [],
           "links": []}
    (esc / "y.jsonl").write_text(json.dumps(rec) + "\n")
    assert kvrelay_main(["trace", "r", "--dir", str(esc)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "evil?[2Jname" in out
