"""Ray backend for the launcher (``kvrelay serve --backend ray``): each
worker is a process owned by a Ray actor that runs on a node of the worker's
site. Sites map to Ray custom resources: an operator gives every node of
Toronto ``site:toronto`` (``ray start --resources '{"site:toronto": 8}'``),
and each worker actor takes one unit of it, so it can only land there.

The router stays with the launcher (the node where ``kvrelay serve`` runs);
workers register with it over the network exactly as local ones do, so the
router's address (``router.host``) must be reachable from every node. With
several routers (``routers:``), each runs as an actor on a node of its own
site, like a worker; each router's ``host`` (or ``advertise``) must then be
reachable from every node, and etcd and PostgreSQL too (the launcher starts
them on its own loopback only when no endpoints are given, which serves
nodes on this machine).

Ray 2.60 authenticates every connection with a cluster token by default.
A local Ray started here makes and uses its own token; to join an existing
cluster, this machine needs that cluster's token (``RAY_AUTH_TOKEN`` or
``~/.ray/auth_token``, as Ray documents). We never turn authentication off."""

from __future__ import annotations

import atexit
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from kvrelay.runtime.addresses import is_loopback
from kvrelay.runtime.kvsecret import TLS_DIR_ENV, TLS_ENV
from kvrelay.runtime.renewal import write_material
from kvrelay.runtime.tls import Pems

log = logging.getLogger(__name__)

SITE_RESOURCE = "site:{}"
CALL_TIMEOUT_S = 30.0


def site_resource(site: str) -> str:
    return SITE_RESOURCE.format(site)


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class WorkerActor:
        """Owns one worker (or router) process on this node; it dies with the actor."""

        def __init__(self, module: str, args: list[str], env: dict[str, str], capture: bool = False) -> None:
            # the certificate into a folder of this node's, where write_tls renews it and the process follows it
            self.tls_dir = tls_folder(env)
            # this node's Python, not the launcher's path: nodes may differ; the
            # worker asks for SIGTERM when this actor's process exits (runtime/lifetime.py)
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], env={**os.environ, **env},
                                         stdout=subprocess.PIPE if capture else None, text=capture)

        def write_tls(self, ca: bytes, cert: bytes, key: bytes) -> None:
            """A renewed certificate into the process's folder (the launcher's keeper sends it)."""
            if self.tls_dir is not None:
                write_material(self.tls_dir, ca, cert, key)

        def readline(self, timeout: float) -> str:
            """The process's next line of output ("" when none came within ``timeout``, or it ended)."""
            out = self.proc.stdout
            if out is None or not select.select([out], [], [], timeout)[0]:
                return ""
            return out.readline()

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def pid(self) -> int:
            return self.proc.pid

        def poll(self) -> int | None:
            return self.proc.poll()

        def signal(self, kill: bool) -> None:
            if self.proc.poll() is None:
                (self.proc.kill if kill else self.proc.terminate)()

        def wait(self, timeout: float | None) -> int | None:
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return None

    return WorkerActor


def tls_folder(env: dict[str, str]) -> Path | None:
    """On the actor's node: the certificate the launcher put in ``env`` (as PEM) written to a
    private folder of this node's instead, ``env`` naming that folder (``KVRELAY_TLS_DIR``) so the
    process follows it; None when ``env`` carries no certificate (TLS off)."""
    pem = {k: env.pop(v) for k, v in TLS_ENV.items() if v in env}
    if "cert" not in pem:
        return None
    folder = Path(tempfile.mkdtemp(prefix="kvrelay-tls-"))  # 0700
    atexit.register(shutil.rmtree, folder, True)
    write_material(folder, pem["ca"].encode(), pem["cert"].encode(), pem["key"].encode())
    env[TLS_DIR_ENV] = str(folder)
    return folder


class RayWorker:
    """A worker process on a Ray node, seen through its actor (WorkerProc)."""

    def __init__(self, name: str, actor) -> None:
        import ray

        self._ray = ray
        self.name = name
        self.actor = actor
        self.pid = -1
        self._exit: int | None = None

    def _call(self, method, *args, timeout: float = CALL_TIMEOUT_S):
        return self._ray.get(method.remote(*args), timeout=timeout)

    def node_id(self) -> str:
        return self._call(self.actor.node_id)

    def write_tls(self, pems: Pems) -> None:
        """Delivers a renewed certificate to the process's folder on its node; OSError when its
        actor cannot be reached (gone, or not answering in time)."""
        try:
            self._call(self.actor.write_tls, pems.ca_pem, pems.cert_pem, pems.key_pem)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError) as exc:
            raise OSError(f"{self.name}'s actor did not take its renewed certificate: {exc}") from None

    def readline(self, timeout: float) -> str:
        """The process's next line of output, when it was started to capture it ("" when none came)."""
        return self._call(self.actor.readline, timeout, timeout=timeout + CALL_TIMEOUT_S)

    def poll(self) -> int | None:
        if self._exit is not None:
            return self._exit
        try:
            code = self._call(self.actor.poll, timeout=5.0)
        except self._ray.exceptions.GetTimeoutError:
            return None  # still being scheduled, or busy
        except self._ray.exceptions.RayActorError:
            code = -9  # the actor (and with it the process) is gone
        if code is not None:
            self._exit = code
            self._ray.kill(self.actor)
        return code

    def terminate(self) -> None:
        self._signal(False)

    def kill(self) -> None:
        self._signal(True)

    def _signal(self, kill: bool) -> None:
        try:
            self._call(self.actor.signal, kill)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            self._ray.kill(self.actor)

    def wait(self, timeout: float | None = None) -> int:
        if self._exit is not None:
            return self._exit
        try:
            code = self._call(self.actor.wait, timeout, timeout=(timeout or CALL_TIMEOUT_S) + 10)
        except self._ray.exceptions.RayActorError:
            code = -9
        if code is None:  # only a wait with a timeout comes back without a code
            raise subprocess.TimeoutExpired(self.name, timeout if timeout is not None else CALL_TIMEOUT_S)
        self._exit = code
        self._ray.kill(self.actor)
        return code


class RayPlaintext(RuntimeError):
    """Secrets would cross the network in clear: Ray's TLS is off and a node is elsewhere."""


def check_nodes_local(nodes: list[dict]) -> None:
    """RayPlaintext naming the first live node whose address is not this machine's."""
    for node in nodes:
        address = node.get("NodeManagerAddress", "")
        if node.get("Alive") and not is_this_machine(address):
            raise RayPlaintext(
                f"Ray's TLS is off (RAY_USE_TLS) and Ray node {node.get('NodeID', '?')[:12]} is at {address}, "
                "not on this machine: each worker's certificate key and the KV secret would reach it in clear. "
                "Turn Ray's TLS on on every node before `ray start` (README: Two Ray nodes)")


def is_this_machine(address: str) -> bool:
    """A loopback address, or one of this machine's own (a socket binds to it): traffic to it stays here."""
    if is_loopback(address):
        return True
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
    except (OSError, ValueError):
        return False
    return True


class RayBackend:
    """Starts workers as Ray actors on the nodes of their site.

    ``address``: an existing Ray cluster (``ray://`` or ``host:port``); None
    joins the cluster this process is already connected to, or starts a
    local one whose single node carries every site's resource. ``ray_tls``:
    Ray's own TLS is on (``RAY_USE_TLS``, which the caller reads). Each
    worker's certificate key and the KV secret travel to it with its actor,
    over Ray's control channel: without Ray's TLS, a node anywhere but this
    machine is refused (RayPlaintext), before anything is sent."""

    def __init__(self, sites: list[str], address: str | None = None, workers_per_site: int = 64,
                 ray_tls: bool = False) -> None:
        import ray

        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            if address is None:
                ray.init(include_dashboard=False, log_to_driver=False,
                         resources={site_resource(s): workers_per_site for s in sites})
            else:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True
        if not ray_tls:
            check_nodes_local(ray.nodes())
        have = ray.cluster_resources()
        missing = [s for s in sites if have.get(site_resource(s), 0) < 1]
        if missing:
            raise RuntimeError(f"no Ray node offers {', '.join(site_resource(s) for s in missing)}: start the "
                               f"nodes of each site with ray start --resources '{{\"site:<name>\": 8}}'")
        self._actor = _actor_class()

    def start(self, name: str, module: str, args: list[str], site: str, env: dict[str, str], *,
              preload_vllm: bool = False) -> RayWorker:
        """A worker as an actor on a node of ``site`` (a process of its own: nothing to preload)."""
        actor = self._actor.options(resources={site_resource(site): 1}).remote(module, args, env)
        return RayWorker(name, actor)

    def start_router(self, name: str, args: list[str], site: str, env: dict[str, str]) -> RayWorker:
        """One of several routers, as an actor on a node of ``site``; its output kept for
        :meth:`RayWorker.readline` (the launcher reads its READY line)."""
        actor = self._actor.options(resources={site_resource(site): 1}).remote("kvrelay.router", args, env, True)
        return RayWorker(name, actor)

    def close(self) -> None:
        if self._owns_ray:
            self._ray.shutdown()
