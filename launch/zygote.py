"""Workers forked from a preloaded process: the launcher's fast start.

A worker spends about two seconds importing torch, gRPC and kvrelay before
it does anything of its own. The zygote (``python -m kvrelay.launch.zygote``)
does that import once, then forks a worker for each request the launcher
sends: the fork runs the worker's ``main`` with its own arguments and
environment, as ``python -m <module>`` would. The zygote is started fresh
(not forked from the launcher, which has threads) and stays single-threaded,
so every fork is of a process with nothing in flight; what it imported is
frozen out of the garbage collector's reach (``gc.freeze``), so a worker's
collections do not walk it (nor copy its pages). Scale-ups, replacements
and test clusters start that much sooner (benchmarks/RESULTS.md).

Lifetime: the zygote exits when the launcher closes its socket or dies
(PR_SET_PDEATHSIG); each worker asks for SIGTERM when its parent, the zygote,
exits (runtime/lifetime.py). The zygote reaps its workers and tells the
launcher each exit code. Workers started through a command prefix (``ip
netns exec`` under emulated cities) are plain processes (launch/local.py).

A worker that runs vLLM on the CPU spends about eleven seconds more
importing vLLM: the launcher asks for it (``preload_vllm``), and the zygote
imports vLLM once, before its first such fork, as the worker would
(runtime/vllm_engine.py ``preload``), so later vLLM workers start without it.

The router is forked the same way (its READY line through a pipe the
launcher makes: its write end travels over the socket with the request).

Wire: JSON lines over a socket pair. Launcher to zygote: ``{"module",
"args", "env", "preload_vllm", "stdout"}`` (``stdout``: the request's
first bytes carry a descriptor, SCM_RIGHTS, the child's standard
output); zygote to launcher: ``{"started": pid}``, ``{"refused":
reason}``, ``{"exit": pid, "code": code}`` (a negative code: the signal)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
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
from typing import IO

from kvrelay.runtime.lifetime import die_with_parent

PRELOAD = ("kvrelay.prefill_worker.main", "kvrelay.decode_worker.main", "kvrelay.router.main")
"""What every worker and the router import: imported once, by the zygote."""
WORKER_MODULES = frozenset({"kvrelay.prefill_worker", "kvrelay.decode_worker", "kvrelay.router"})
"""The modules a zygote starts (anything else is refused)."""
MAX_FDS = 4
"""File descriptors one message of the launcher may carry (a child's stdout)."""
START_TIMEOUT_S = 120.0
"""How long a start may wait for the zygote's answer (the first includes its imports)."""
REAP_INTERVAL_S = 0.1
_PR_SET_NAME = 15


class ZygoteWorker:
    """A worker forked by the zygote, with ``subprocess.Popen``'s interface
    as the launcher uses it (the ``WorkerProc`` protocol)."""

    __slots__ = ("_exited", "pid", "returncode", "stdout")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        """The exit code (negative: the signal that ended it); None while it runs."""
        self.stdout: IO[str] | None = None
        """Its standard output, where it was started with ``stdout=True`` (the router's READY line)."""
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

    def start(self, module: str, args: list[str], env: dict[str, str], *, preload_vllm: bool = False,
              stdout: bool = False) -> ZygoteWorker:
        """Forks ``module``'s main with ``args`` and exactly ``env`` as its environment; ``preload_vllm``:
        from the zygote with vLLM imported (imported first if it is not yet); ``stdout``: its standard
        output a pipe, read from the worker's ``stdout`` (else it is the zygote's, the launcher's)."""
        if module not in WORKER_MODULES:
            raise ValueError(f"the zygote starts only {sorted(WORKER_MODULES)}, not {module!r}")
        req = json.dumps({"module": module, "args": args, "env": env, "preload_vllm": preload_vllm,
                          "stdout": stdout}).encode() + b"\n"
        read_end, write_end = os.pipe() if stdout else (-1, -1)
        with self._lock:
            try:
                if stdout:  # the write end travels with the request's first bytes
                    sent = socket.send_fds(self.sock, [req], [write_end])
                    self.sock.sendall(req[sent:])
                else:
                    self.sock.sendall(req)
            finally:
                if stdout:
                    os.close(write_end)
            try:
                answer = self._answers.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                answer = {"refused": f"no answer within {START_TIMEOUT_S:.0f} s"}
        worker = answer.get("worker")
        if not isinstance(worker, ZygoteWorker):
            if stdout:
                os.close(read_end)
            raise RuntimeError(f"the zygote could not start {module}: {answer.get('refused', answer)}")
        if stdout:
            worker.stdout = os.fdopen(read_end, "r")
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


def _child(sock: socket.socket, req: dict, stdout: int | None) -> None:
    """In the fork: become the worker ``req`` names (``stdout``: the fd its standard output goes to),
    then exit with its code."""
    code = 1
    try:
        sock.close()
        if stdout is not None:
            os.dup2(stdout, 1)
            os.close(stdout)
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


def _refuse(sock: socket.socket, reason: str) -> None:
    sock.sendall(json.dumps({"refused": reason}).encode() + b"\n")


def _fork(sock: socket.socket, line: bytes, fds: list[int]) -> None:
    """Forks the worker ``line`` asks for; ``fds``: descriptors received and not yet taken (a request
    with ``stdout`` takes the first)."""
    req = json.loads(line)
    stdout = fds.pop(0) if req.get("stdout") is True and fds else None
    if req.get("stdout") is True and stdout is None:
        _refuse(sock, "a request for a piped stdout came without its descriptor")
        return
    if req.get("module") not in WORKER_MODULES:
        if stdout is not None:
            os.close(stdout)
        _refuse(sock, f"unknown module {req.get('module')!r}")
        return
    if req.get("preload_vllm") is True:
        try:
            importlib.import_module("kvrelay.runtime.vllm_engine").preload()
        except Exception as exc:  # the worker itself then meets (and reports) what failed
            print(f"kvrelay zygote: vLLM not preloaded: {exc!r}", file=sys.stderr)
    sys.stdout.flush()
    gc.freeze()  # what the imports made stays out of every fork's collections (and its pages shared)
    pid = os.fork()
    if pid == 0:
        _child(sock, req, stdout)
    if stdout is not None:
        os.close(stdout)
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
    fds: list[int] = []
    while True:
        if sel.select(REAP_INTERVAL_S):
            data, received, _, _ = socket.recv_fds(sock, 1 << 16, MAX_FDS)
            fds += received
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                _fork(sock, line, fds)
        _reap(sock)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
