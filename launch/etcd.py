"""Runs an etcd cluster on this machine for a deployment with several routers
(`kvrelay serve`, the tests): Debian's ``etcd`` (``etcd-server``), ``members``
processes on loopback, each with a certificate from the cluster CA for its
client and peer listeners, admitting only clients that present one from the
same CA (``--client-cert-auth``), and of those only the routers' (users and
roles, launch/etcd_auth.py: :meth:`EtcdCluster.secure`). With TLS off (one
machine, comparisons), plain HTTP on loopback."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvrelay.launch.credentials import CRL_FILE, ClusterCredentials
from kvrelay.launch.etcd_auth import secure
from kvrelay.launch.renewal import CertKeeper
from kvrelay.runtime.addresses import free_port
from kvrelay.runtime.etcd import EtcdClient, EtcdError
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.runtime.rpc import Dialer

ETCD_BINARY = "etcd"
INSTALL_HINT = "install Debian's etcd-server (apt-get install etcd-server; `make install` does as root)"


@dataclass(slots=True)
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    folder: Path
    host: str = "127.0.0.1"
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"


class EtcdCluster:
    """``members`` etcd processes on loopback, started by :meth:`start`, each killable and restartable."""

    def __init__(self, members: int, folder: Path, creds: ClusterCredentials | None, site: str,
                 host: str = "127.0.0.1", keeper: CertKeeper | None = None) -> None:
        """``folder``: the members' data and certificates (the caller's, removed with it); ``creds``:
        the cluster CA that issues each member its certificate (None: plaintext on loopback);
        ``site``: the site its members' certificates name; ``host``: the address they listen on
        (loopback, or the emulated cities' gateway, which routers in the cities' namespaces reach);
        ``keeper``: renews the members' certificates in their folders (etcd reads them at each
        handshake), issued once by ``creds`` without it."""
        if shutil.which(ETCD_BINARY) is None:
            raise RuntimeError(f"etcd is not installed: {INSTALL_HINT}")
        self.creds = creds
        self.scheme = "https" if creds is not None else "http"
        self.token = "kvrelay-" + secrets.token_hex(6)
        self.host = host
        names = tuple(dict.fromkeys((host, "127.0.0.1", "localhost")))
        self.members = [EtcdMember(f"m{i}", free_port(), free_port(), folder / f"m{i}", host) for i in range(members)]
        for m in self.members:
            m.folder.mkdir(parents=True, mode=0o700, exist_ok=True)
            ident = Identity(site, CertRole.ETCD, m.name)
            if keeper is not None:
                keeper.issue_files(f"etcd/{m.name}", ident, names, m.folder)
            elif creds is not None:
                creds.write_files(ident, names, m.folder)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def _args(self, m: EtcdMember, state: str) -> list[str]:
        url = f"{self.scheme}://{self.host}"
        cluster = ",".join(f"{o.name}={url}:{o.peer_port}" for o in self.members)
        args = [ETCD_BINARY, "--name", m.name, "--data-dir", str(m.folder / "data"),
                "--listen-client-urls", f"{url}:{m.client_port}", "--advertise-client-urls", f"{url}:{m.client_port}",
                "--listen-peer-urls", f"{url}:{m.peer_port}", "--initial-advertise-peer-urls", f"{url}:{m.peer_port}",
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", self.token, "--logger", "zap", "--log-level", "error",
                "--heartbeat-interval", "100", "--election-timeout", "1000"]
        if self.creds is not None:
            tls = {"cert-file": "cert.pem", "key-file": "key.pem", "trusted-ca-file": "ca.pem"}
            for prefix in ("", "peer-"):
                args += [x for flag, f in tls.items() for x in (f"--{prefix}{flag}", str(m.folder / f))]
            crl = str(m.folder / CRL_FILE)  # read at every handshake: a serial revoked is refused at once
            args += ["--client-cert-auth", "--peer-client-cert-auth", "--client-crl-file", crl, "--peer-crl-file", crl]
        return args

    def _spawn(self, m: EtcdMember, state: str) -> None:
        log = open(m.folder / "etcd.log", "ab")  # noqa: SIM115  the child keeps it
        with log:
            m.proc = subprocess.Popen(self._args(m, state), stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def start(self, dialer: Dialer, timeout_s: float = 30.0) -> list[str]:
        """Starts every member and waits until the cluster has a leader; the client endpoints.
        ``dialer``: a certificate the members admit (the launcher's router's)."""
        for m in self.members:
            self._spawn(m, "new")
        try:
            asyncio.run(self._await_leader(dialer, timeout_s))
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def secure(self, dialer: Dialer, prefix: str, routers: list[Identity]) -> None:
        """Only ``routers`` may read and write under ``prefix`` from now on (launch/etcd_auth.py);
        ``dialer``: a certificate the members admit. TLS only: without it etcd has no names to check."""
        if self.creds is None:
            raise RuntimeError("etcd's users are named by their certificates: plaintext etcd has none")

        async def run() -> None:
            client = EtcdClient(self.endpoints, dialer, timeout_s=10.0)
            try:
                await secure(client, prefix, routers)
            finally:
                await client.close()
        try:
            asyncio.run(run())
        except EtcdError as exc:
            raise RuntimeError(f"could not give etcd its users and roles: {exc}") from None

    async def _await_leader(self, dialer: Dialer, timeout_s: float, only: EtcdMember | None = None) -> None:
        """Until the members (``only``: that one) answer with a leader; RuntimeError naming a member
        that exited, or after ``timeout_s``."""
        client = EtcdClient([only.endpoint] if only else self.endpoints, dialer, timeout_s=2.0)
        end = time.monotonic() + timeout_s
        try:
            while True:
                dead = [m.name for m in self.members if m.proc is not None and m.proc.poll() is not None]
                if dead:
                    raise RuntimeError(f"etcd member {dead[0]} exited: {self._tail(dead[0])}")
                try:
                    if (await client.status()).leader:
                        return
                except EtcdError as exc:
                    if time.monotonic() > end:
                        what = f"member {only.name} was not back" if only else "had no leader"
                        raise RuntimeError(f"etcd {what} within {timeout_s:g} s: {exc}") from None
                await asyncio.sleep(0.1)
        finally:
            await client.close()

    def _tail(self, name: str) -> str:
        m = next(m for m in self.members if m.name == name)
        try:
            return (m.folder / "etcd.log").read_text(errors="replace")[-600:]
        except OSError:
            return "(no log)"

    def cut_connections(self, dialer: Dialer, timeout_s: float = 30.0) -> None:
        """Restarts the members one at a time, each back and in the cluster before the next (a
        majority always serves): the connections open now, a revoked certificate's among them, end,
        and every client connects again through a handshake that checks the revocation list."""
        for i, m in enumerate(self.members):
            self.restart(i)
            asyncio.run(self._await_leader(dialer, timeout_s, only=m))

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (a crash)."""
        proc = self.members[index].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def restart(self, index: int) -> None:
        """Starts member ``index`` again on its data (it rejoins the cluster)."""
        self.kill(index)
        self._spawn(self.members[index], "existing")

    def stop(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.terminate()
        for m in self.members:
            if m.proc is not None:
                try:
                    m.proc.wait(10)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(5)
