"""``/livez`` and ``/readyz`` of one process, for an orchestrator's probes
(Kubernetes ``httpGet``), on their own small HTTP listener (``health:`` in
the config).

- **live**: the process's event loop runs a callback within
  :data:`LOOP_DEADLINE_S` and its own check passes (a worker's engine
  thread is alive). A process that is not live should be restarted.
- **ready**: live, and the process's readiness check passes (the router:
  its listeners are serving; a worker: registered with the router and not
  draining). A process that is not ready should get no new work.

The answers hold no data beyond the check's one-line reason (no tenant, no
request, no address), so the listener needs no credentials; it answers only
``GET`` of the two paths, each connection within :data:`SOCKET_TIMEOUT_S`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOOP_DEADLINE_S = 2.0
"""A loop that cannot run a no-op callback within this is stuck: not live."""
SOCKET_TIMEOUT_S = 5.0
"""A probe connection that sends no request within this is closed."""

Check = Callable[[], str | None]
"""A check: None when it passes, else why it does not (one line)."""


@dataclass(frozen=True, slots=True)
class HealthChecks:
    """What a process's probes ask."""

    loop: asyncio.AbstractEventLoop
    """The process's event loop (must keep answering)."""
    live: Check
    """Beyond a responsive loop: is the process able to work at all."""
    ready: Check
    """Beyond being live: should the process get new work."""

    def loop_problem(self) -> str | None:
        """None when the loop runs a callback within LOOP_DEADLINE_S."""
        future = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop)
        try:
            future.result(LOOP_DEADLINE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return f"the event loop did not answer within {LOOP_DEADLINE_S:g} s"
        except (RuntimeError, concurrent.futures.CancelledError) as exc:
            return f"the event loop is not running ({exc or type(exc).__name__})"
        return None

    def answer(self, path: str) -> tuple[int, str | None] | None:
        """(HTTP status, reason) for a probe path; None for any other path."""
        if path not in ("/livez", "/readyz"):
            return None
        problem = self.loop_problem() or self.live()
        if problem is None and path == "/readyz":
            problem = self.ready()
        return (200 if problem is None else 503), problem


def _handler(checks: HealthChecks) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = SOCKET_TIMEOUT_S
        server_version = "kvrelay-health"
        sys_version = ""

        def do_GET(self) -> None:  # http.server's name
            answer = checks.answer(self.path.split("?", 1)[0])
            if answer is None:
                self._send(404, {"status": "not found", "paths": ["/livez", "/readyz"]})
            else:
                status, reason = answer
                self._send(status, {"status": "ok"} if reason is None else {"status": "fail", "reason": reason})

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True

        def log_message(self, format: str, *args) -> None:  # http.server's name
            pass  # probes every few seconds: no log line each

    return Handler


class HealthServer:
    """The probe listener of one process, in a thread of its own."""

    def __init__(self, host: str, port: int, checks: HealthChecks) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler(checks))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvrelay-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(LOOP_DEADLINE_S)


def serve_health(host: str, port: int | None, checks: HealthChecks) -> HealthServer | None:
    """The probe listener (None when ``port`` is None: probes off); SystemExit when the port is taken."""
    if port is None:
        return None
    try:
        return HealthServer(host, port, checks)
    except OSError as exc:
        raise SystemExit(f"health: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
