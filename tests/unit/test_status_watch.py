"""`kvrelay status` text (render_status, from hand-built responses) and the
``--watch`` loop's frames."""

from __future__ import annotations

import contextlib
import io
import re

import grpc
import pytest

from kvrelay.cli import admin as cli_admin
from kvrelay.cli.main import main
from kvrelay.cli.watch import CLEAR, frame, human_bytes, latency_line, render_status, watch
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import worker_pb2 as wpb


def _workers(requests: int = 14) -> wpb.ListWorkersResponse:
    resp = wpb.ListWorkersResponse(policy="cost", router_metrics_address="127.0.0.1:9464")
    resp.workers.add(info=wpb.WorkerInfo(worker_id="local/decode/0", site="local", role=wpb.ROLE_DECODE,
                                         address="127.0.0.1:5001", transport="tcp",
                                         metrics_address="127.0.0.1:9465"),
                     load=wpb.WorkerLoad(free_blocks=25, total_blocks=100, running=3), healthy=True)
    resp.workers.add(info=wpb.WorkerInfo(worker_id="local/prefill/0", site="local", role=wpb.ROLE_PREFILL),
                     healthy=False)
    resp.links.add(name="toronto-montreal", rtt_ms=8, gbps=10, transport="tcp", protection="aead", up=True,
                   kv_bytes_per_s=12.3e6, kv_codec="int8", measured_gbps=0.04871, measured_floor_gbps=0.05,
                   measured_rtt_ms=8.21, rate_samples=5, rate_source="measured", placement_gbps=0.04871)
    resp.links.add(name="local", up=False, down_reason="no route", measured_floor_gbps=0.291,
                   rate_source="lower bound", placement_gbps=0.291)
    resp.latency.CopyFrom(wpb.LatencySummary(window_s=60, requests=requests, ttft_p50_ms=120.4, ttft_p90_ms=340,
                                             itl_p50_ms=41, itl_p90_ms=60.2))
    return resp


def _pools() -> apb.ListPoolsResponse:
    return apb.ListPoolsResponse(pools=[apb.PoolStatus(site="local", role="decode", desired=1, active=1,
                                                       workers=["local/decode/0"])])


def test_render_status_tables_and_lines():
    text = render_status(_workers(), _pools())
    for header in ("DESIRED", "WORKER", "KV FREE/TOTAL", "KV USED", "METRICS", "LINK", "MEASURED RTT", "MEASURED GBPS",
                   "PLACEMENT USES", "KV CODEC", "STATE", "KV RATE"):
        assert header in text
    assert re.search(r"local/decode/0\s+local\s+decode\s+ok\s+0\s+3\s+0\s+25/100\s+75%", text)
    assert re.search(r"local/prefill/0\s+local\s+prefill\s+UNHEALTHY.*0/0\s+-\s", text)
    assert "127.0.0.1:9465" in text and "router metrics: 127.0.0.1:9464" in text
    # configured vs measured: RTT, rate (over 5 link-bound transfers), and what placement uses
    assert re.search(r"toronto-montreal\s+8\s+8\.21\s+10\s+0\.0487 \(5\)\s+0\.0487 \(measured\)\s+tcp\s+aead"
                     r"\s+int8\s+up\s+12\.3 MB/s", text)
    # only lower bounds (no transfer waited for the link), no RTT measured; no codec named (an older router)
    assert re.search(r"local\s+0\s+-\s+0\s+>=0\.291\s+0\.291 \(lower bound\)\s.*\snone\s+DOWN", text)
    assert "DOWN (no route)" in text and "0 B/s" in text
    assert "placement policy: cost\n" in text
    assert "last 60 s: 14 requests, TTFT p50 120 ms p90 340 ms, ITL p50 41 ms p90 60 ms\n" in text


def test_render_status_without_requests_pools_or_metrics():
    resp = _workers(requests=0)
    resp.router_metrics_address = ""
    text = render_status(resp, "PERMISSION_DENIED: operators only")
    assert text.startswith("(pools: PERMISSION_DENIED: operators only)\n")
    assert "no requests finished in the last 60 s" in text and "router metrics: off" in text


def test_render_status_names_the_routers_and_their_shared_state():
    resp = _workers()
    assert "ROUTER" not in render_status(resp, _pools())  # one router: nothing to say
    resp.router_name, resp.coordination = "ont", "etcd at 127.0.0.1:2379: reached; 2 router(s) live"
    resp.routers.add(name="ont", site="toronto", jurisdiction="CA-ON", address="10.0.0.2:50051",
                     internal_address="10.0.0.2:50052")
    resp.routers.add(name="qc", site="montreal", jurisdiction="CA-QC", address="10.0.0.1:50051",
                     internal_address="10.0.0.1:50052")
    text = render_status(resp, _pools())
    assert re.search(r"ont \(this one\)\s+toronto\s+CA-ON\s+10\.0\.0\.2:50051\s+10\.0\.0\.2:50052", text)
    assert re.search(r"\nqc\s+montreal\s+CA-QC", text)
    assert text.endswith("shared state: etcd at 127.0.0.1:2379: reached; 2 router(s) live\n")


def test_latency_line_forms():
    assert latency_line(wpb.LatencySummary()) == "latency: not reported by this router"
    one = latency_line(wpb.LatencySummary(window_s=30, requests=1, ttft_p50_ms=5, ttft_p90_ms=5))
    assert one.startswith("last 30 s: 1 request, TTFT p50 5 ms")


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 999, 1000, 12_300_000, 4.5e9)] == ["0 B", "999 B", "1.0 kB", "12.3 MB",
                                                                           "4.5 GB"]
    assert human_bytes(12_345, "/s") == "12.3 kB/s"


def test_frames_clear_a_terminal_and_are_separated_elsewhere():
    assert frame("body\n", 0, 2, tty=True, first=False).startswith(CLEAR + "kvrelay status ")
    first, later = frame("body\n", 0, 2, tty=False, first=True), frame("body\n", 0, 2, tty=False, first=False)
    assert CLEAR not in first + later
    assert first.startswith("== kvrelay status ") and first.endswith("==\nbody\n")
    assert later == "\n" + first


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_watch_counts_frames_sleeps_between_and_stops_on_ctrl_c():
    out, sleeps = io.StringIO(), []
    assert watch(lambda: "body\n", out, 1.5, count=3, sleep=sleeps.append, clock=lambda: 0.0) == 0
    assert out.getvalue().count("== kvrelay status") == 3 and sleeps == [1.5, 1.5]
    tty = _Tty()
    assert watch(lambda: "body\n", tty, 2, count=2, sleep=lambda s: None) == 0
    assert tty.getvalue().count(CLEAR) == 2
    calls = []

    def render() -> str:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return "body\n"
    assert watch(render, io.StringIO(), 2, sleep=lambda s: None) == 0


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


def test_status_watch_command(monkeypatch, capsys):
    answers = [(_workers(), _pools()), _Unavailable()]

    def fetch(ch):
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    class Dialer:
        def sync(self, address: str):
            return contextlib.nullcontext()
    monkeypatch.setattr(cli_admin, "operator_dialer", lambda args: Dialer())
    monkeypatch.setattr(cli_admin, "fetch_status", fetch)
    assert main(["status", "--count", "2", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    assert out.count("== kvrelay status") == 2 and "KV USED" in out
    assert "kvrelay: error: UNAVAILABLE: connection refused (trying again every 0.01 s)" in out


@pytest.mark.parametrize("flags", [["--interval", "0"], ["--count", "0"]])
def test_status_rejects_bad_watch_flags(flags, capsys):
    assert main(["status", *flags]) == 2
    assert "--interval must be > 0" in capsys.readouterr().err
