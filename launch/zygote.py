"""Workers forked from a preloaded process: the launcher's fast start.

A worker spends about two seconds importing torch, gRPC and kvrelay before
it does anything of its own. The zygote (``python -m kvrelay.launch.zygote``)
does that import once, then forks a worker for each request the launcher
sends: the fork runs the worker's ``main`` with its own arguments and
environment, as ``python -m <module>`` would. The zygote is started fresh
(not forked from the launcher, which has threads) and stays single-threaded,
so every fork is of a process with nothing in flight. Scale-ups, replacements
and test clusters start that much sooner (benchmarks/RESULTS.md).

Lifetime: the zygote exits when the launcher closes its socket or dies
(PR_SET_PDEATHSIG); each worker asks for SIGTERM when its parent, the zygote,
exits (runtime/lifetime.py). The zygote reaps its workers and tells the
launcher each exit code. Workers started through a command prefix (``ip
netns exec`` under emulated cities) are plain processes (launch/local.py).

Wire: JSON lines over a socket pair. Launcher to zygote: ``{"module",
"args", "env"}``; zygote to launcher: ``{"started": pid}``, ``{"refused":
reason}``, ``{"exit": pid, "code": code}`` (a negative code: the signal)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback

from kvrelay.runtime.lifetime import die_with_parent

PRELOAD = ("kvrelay.prefill_worker.main", "kvrelay.decode_worker.main")
"""What every worker imports: imported once, by the zygote."""
WORKER_MODULES = frozenset({"kvrelay.prefill_worker", "kvrelay.decode_worker"})
"""The modules a zygote starts (anything else is refused)."""
START_TIMEOUT_S = 120.0
"""How long a start may wait for the zygote's answer (the first includes its imports)."""
REAP_INTERVAL_S = 0.1
_PR_SET_NAME = 15


class ZygoteWorker:
    """A worker forked by the zygote, with ``subprocess.Popen``'s interface
    as the launcher uses it (the ``WorkerProc`` protocol)."""

    __slots__ = ("_exited", "pid", "returncode")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        """The exit code (negative: the signal that ended it); None while it runs."""
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not yet reaped: the pid is still this worker's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None  # set before the event
        return self.returncode


class Zygote:
    """The launcher's side: starts the zygote process and asks it for workers."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.launch.zygote", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),))
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()
        self._answers: queue.Queue[dict] = queue.Queue()
        self._workers: dict[int, ZygoteWorker] = {}
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def start(self, module: str, args: list[str], env: dict[str, str]) -> ZygoteWorker:
        """Forks ``module``'s main with ``args`` and exactly ``env`` as its environment."""
        if module not in WORKER_MODULES:
            raise ValueError(f"the zygote starts only {sorted(WORKER_MODULES)}, not {module!r}")
        with self._lock:
            self.sock.sendall(json.dumps({"module": module, "args": args, "env": env}).encode() + b"\n")
            try:
                answer = self._answers.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"the zygote did not start {module} within {START_TIMEOUT_S:.0f} s") from None
        worker = answer.get("worker")
        if not isinstance(worker, ZygoteWorker):
            raise RuntimeError(f"the zygote could not start {module}: {answer.get('refused', answer)}")
        return worker

    def _read(self) -> None:
        with self.sock.makefile("rb") as lines:
            for line in lines:
                msg = json.loads(line)
                if "exit" in msg:
                    worker = self._workers.pop(msg["exit"], None)
                    if worker is not None:
                        worker._exit(int(msg["code"]))
                    continue
                if "started" in msg:  # registered before start() sees it: its exit may follow at once
                    msg["worker"] = self._workers[msg["started"]] = ZygoteWorker(int(msg["started"]))
                self._answers.put(msg)
        self._answers.put({"refused": "the zygote exited"})
        for worker in list(self._workers.values()):  # they get SIGTERM from the kernel (PDEATHSIG)
            worker._exit(-signal.SIGTERM)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the zygote sees EOF and exits (the reader holds the fd open)
        except OSError:
            pass  # it is gone already
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


_shared_lock = threading.Lock()
_shared: Zygote | None = None


def shared_zygote() -> Zygote:
    """This process's zygote (started on first use, and again if it died)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive:
            _shared = Zygote()
        return _shared


# -- the zygote process --------------------------------------------------------
def _name_process(module: str) -> None:
    """``kvrelay-prefill`` / ``kvrelay-decode`` in ps, top and pgrep (the command line stays the zygote's)."""
    name = "kvrelay-" + module.rsplit(".", 1)[-1].removesuffix("_worker")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _child(sock: socket.socket, req: dict) -> None:
    """In the fork: become the worker ``req`` names, then exit with its code."""
    code = 1
    try:
        sock.close()
        _name_process(req["module"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [req["module"], *req["args"]]
        code = importlib.import_module(f"{req['module']}.main").main(req["args"])
    except SystemExit as exc:  # as the interpreter ends: an int is the code, anything else is printed
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _fork(sock: socket.socket, line: bytes) -> None:
    req = json.loads(line)
    if req.get("module") not in WORKER_MODULES:
        sock.sendall(json.dumps({"refused": f"unknown module {req.get('module')!r}"}).encode() + b"\n")
        return
    pid = os.fork()
    if pid == 0:
        _child(sock, req)
    sock.sendall(json.dumps({"started": pid}).encode() + b"\n")


def serve(fd: int) -> None:
    """The zygote: imports what workers need, then forks one per request until EOF."""
    die_with_parent()
    for module in PRELOAD:
        importlib.import_module(module)
    sock = socket.socket(fileno=fd)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    buf = b""
    while True:
        if sel.select(REAP_INTERVAL_S):
            data = sock.recv(1 << 16)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                _fork(sock, line)
        _reap(sock)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
