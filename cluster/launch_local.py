"""Local launcher: the router and every worker of the config as processes
on this machine. ``stop()`` (and Ctrl-C / SIGTERM in ``kvrelay serve``)
ends all of them; children also get SIGTERM from the kernel if the
launcher itself dies (PR_SET_PDEATHSIG), so nothing is orphaned."""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.config import ClusterConfig, dump_config
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen


class LocalCluster:
    def __init__(self, cfg: ClusterConfig, model_path: Path, log_level: str = "WARNING") -> None:
        self.cfg = cfg
        self.model_path = Path(model_path)
        self.log_level = log_level
        self.children: list[Child] = []
        self.router_address = ""
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrelay-")
        self.config_path = Path(self._tmp.name) / "cluster.yaml"
        self._secret = secrets.token_hex(32)
        """Per-run KV secret for the workers when the config names no secret file."""

    def _spawn(self, name: str, args: list[str], **kw) -> subprocess.Popen:
        env = dict(os.environ)
        if not self.cfg.kv.secret_file:
            env["KVRELAY_KV_SECRET"] = self._secret
        proc = subprocess.Popen([sys.executable, "-m", *args, "--log-level", self.log_level],
                                preexec_fn=_die_with_parent, env=env, **kw)
        self.children.append(Child(name, proc))
        return proc

    def start(self, timeout_s: float = 180.0) -> str:
        """Starts everything; returns the router address once every worker registered."""
        dump_config(self.cfg, self.config_path)
        common = ["--config", str(self.config_path), "--model-path", str(self.model_path)]
        deadline = time.monotonic() + timeout_s
        try:
            router = self._spawn("router", ["router", *common], stdout=subprocess.PIPE, text=True)
            self.router_address = self._await_ready(router, deadline)
            expected = 0
            for site in self.cfg.sites:
                for role in ("prefill", "decode"):
                    for i in range(getattr(site, role).replicas):
                        self._spawn(f"{site.name}/{role}/{i}",
                                    [f"{role}_worker", *common, "--router", self.router_address,
                                     "--site", site.name, "--index", str(i)])
                        expected += 1
            self._await_workers(expected, deadline)
        except BaseException:
            self.stop()
            raise
        return self.router_address

    def _await_ready(self, proc: subprocess.Popen, deadline: float) -> str:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with code {proc.returncode} before it was ready")
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                if line.startswith("READY "):
                    return line.split()[1]
        raise TimeoutError("router did not become ready in time")

    def _await_workers(self, expected: int, deadline: float) -> None:
        with grpc.insecure_channel(self.router_address) as ch:
            stub = wgrpc.RegistryStub(ch)
            while time.monotonic() < deadline:
                dead = self.dead_children()
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited with code {dead[0].proc.returncode} during startup")
                try:
                    resp = stub.ListWorkers(wpb.ListWorkersRequest(), timeout=2.0)
                    if sum(w.healthy for w in resp.workers) >= expected:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"workers did not all register within the deadline ({expected} expected)")

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to workers, then the router; SIGKILL whatever is left."""
        workers = [c for c in self.children if c.name != "router"]
        routers = [c for c in self.children if c.name == "router"]
        for group in (workers, routers):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + timeout_s
            for c in group:
                try:
                    c.proc.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", c.name)
                    c.proc.kill()
                    c.proc.wait()
        for c in routers:
            if c.proc.stdout:
                c.proc.stdout.close()
        for c in workers:  # shared-memory KV of workers that could not clean up
            for f in Path("/dev/shm").glob(f"kvrelay-*-{c.proc.pid}"):
                f.unlink(missing_ok=True)
        self.children.clear()
        self._tmp.cleanup()
