"""Runs the routers' job database on this machine for a deployment with several
routers (`kvrelay serve`, the tests): Debian's PostgreSQL (``postgresql-15``), a
primary and ``standbys`` streaming replicas on loopback. With certificates
(``creds``), every server presents one from the cluster CA, clients must present
one too (``hostssl ... cert``: no password exists), and the certificate's name
maps to the database role: a router's (``<site>/router/<name>``) to the routers'
role, a store server's (``<site>/store/<name>``) to replication. With TLS off
(one machine, comparisons), plaintext on loopback.

PostgreSQL refuses to run as root: as root, its processes run as the
``postgres`` user over a folder of their own (``/tmp/kvrelay-pg-*``, 0700),
removed by :meth:`PostgresCluster.stop`."""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvrelay.launch.credentials import CRL_FILE, ClusterCredentials
from kvrelay.launch.renewal import CertKeeper
from kvrelay.runtime.addresses import free_port
from kvrelay.runtime.pki import CertRole, Identity

BIN_DIRS = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/17/bin")
INSTALL_HINT = "install Debian's PostgreSQL (apt-get install postgresql-15; `make test` does as root)"
SERVICE_USER = "postgres"
"""Who runs PostgreSQL when the launcher is root (Debian's package creates it)."""
ROUTERS_ROLE_MAP = r"/^[a-z0-9_-]+/router/[a-z0-9_-]+$"
STORES_ROLE_MAP = r"/^[a-z0-9_-]+/store/[a-z0-9_-]+$"
REPLICATION_ROLE = "replicator"


def pg_bin(tool: str) -> str:
    """The path of PostgreSQL's ``tool`` (initdb, pg_ctl, ...); RuntimeError naming the fix when absent."""
    for d in BIN_DIRS:
        if (Path(d) / tool).exists():
            return str(Path(d) / tool)
    found = shutil.which(tool)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {tool} is not installed: {INSTALL_HINT}")
    return found


def installed() -> bool:
    """Whether PostgreSQL's server tools are on this machine."""
    try:
        pg_bin("initdb")
    except RuntimeError:
        return False
    return True


@dataclass(slots=True)
class PgServer:
    name: str
    port: int
    folder: Path
    """Its data (``data/``), certificates and log."""
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def data(self) -> Path:
        return self.folder / "data"


class PostgresCluster:
    """A primary and ``standbys`` streaming replicas on loopback, started by :meth:`start`."""

    def __init__(self, standbys: int, creds: ClusterCredentials | None, site: str, database: str = "kvrelay",
                 user: str = "kvrelay", host: str = "127.0.0.1", keeper: CertKeeper | None = None) -> None:
        """``creds``: the cluster CA that issues each server its certificate (None: plaintext on
        loopback); ``site``: the site its certificates name; ``database``/``user``: what routers use;
        ``host``: the address the servers listen on (loopback, or the emulated cities' gateway);
        ``keeper``: renews the servers' certificates in their folders, each server told to read
        them again (``pg_ctl reload``), issued once by ``creds`` without it."""
        pg_bin("initdb")
        self.creds, self.database, self.user, self.host = creds, database, user, host
        self.keeper = keeper
        self.as_service = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="kvrelay-pg-"))
        self.servers = [PgServer(f"s{i}", free_port(), self.root / f"s{i}", host) for i in range(standbys + 1)]
        names = tuple(dict.fromkeys((host, "127.0.0.1", "localhost")))
        owner = (pwd.getpwnam(SERVICE_USER).pw_uid, pwd.getpwnam(SERVICE_USER).pw_gid) if self.as_service else None
        for s in self.servers:
            s.folder.mkdir(mode=0o700)
            ident = Identity(site, CertRole.STORE, s.name)
            if keeper is not None:
                keeper.issue_files(f"postgres/{s.name}", ident, names, s.folder, owner,
                                   functools.partial(self.reload, s))
            elif creds is not None:
                creds.write_files(ident, names, s.folder)
        if self.as_service:
            service = pwd.getpwnam(SERVICE_USER)
            for path in (self.root, *self.root.rglob("*")):
                os.chown(path, service.pw_uid, service.pw_gid)

    @property
    def endpoints(self) -> list[str]:
        return [s.endpoint for s in self.servers]

    def _run(self, args: list[str], timeout_s: float = 60.0) -> str:
        """Runs a PostgreSQL tool (as the service user when root); its output, or RuntimeError with it."""
        cmd = (["runuser", "-u", SERVICE_USER, "--"] if self.as_service else []) + args
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=self.root,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{Path(args[0]).name} did not finish within {timeout_s:g} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"{Path(args[0]).name} failed: {(done.stderr or done.stdout).strip()[-600:]}")
        return done.stdout

    def _conf(self, s: PgServer) -> str:
        """The settings every server runs with (appended: later lines win over copied ones)."""
        lines = [f"port = {s.port}", f"listen_addresses = '{self.host}'", f"unix_socket_directories = '{s.folder}'",
                 "shared_buffers = 16MB", "max_connections = 60", "wal_level = replica", "hot_standby = on",
                 "fsync = on", "synchronous_commit = on", "log_min_messages = warning"]
        if self.creds is not None:
            lines += ["ssl = on", f"ssl_cert_file = '{s.folder / 'cert.pem'}'",
                      f"ssl_key_file = '{s.folder / 'key.pem'}'", f"ssl_ca_file = '{s.folder / 'ca.pem'}'",
                      f"ssl_crl_file = '{s.folder / CRL_FILE}'"]  # read again at each reload
        return "\n".join(lines) + "\n"

    def _hba(self) -> str:
        if self.creds is None:
            return ("local all all peer\n"
                    f"host {self.database} {self.user} {self.host}/32 trust\n"
                    f"host replication {REPLICATION_ROLE} {self.host}/32 trust\n")
        return ("local all all peer\n"
                f"hostssl {self.database} {self.user} all cert map=routers\n"
                f"hostssl replication {REPLICATION_ROLE} all cert map=stores\n")

    def _conninfo(self, target: PgServer, own: PgServer) -> str:
        """How server ``own`` (a standby) reaches ``target`` for replication, with its own certificate."""
        info = f"host={self.host} port={target.port} user={REPLICATION_ROLE} connect_timeout=10"
        if self.creds is not None:
            info += (f" sslmode=verify-full sslrootcert={own.folder / 'ca.pem'} sslcert={own.folder / 'cert.pem'}"
                     f" sslkey={own.folder / 'key.pem'}")
        return info

    def start(self, timeout_s: float = 60.0) -> list[str]:
        """Initializes and starts the primary, creates the routers' role and database, then
        each standby from a base backup of it; the endpoints once every standby streams."""
        primary = self.servers[0]
        try:
            self._run([pg_bin("initdb"), "-D", str(primary.data), "--auth-local=peer", "--auth-host=reject",
                       "-E", "UTF8", "--locale=C"], timeout_s)
            with open(primary.data / "postgresql.conf", "a") as f:
                f.write(self._conf(primary))
            (primary.data / "pg_hba.conf").write_text(self._hba())
            (primary.data / "pg_ident.conf").write_text(
                f"routers {ROUTERS_ROLE_MAP} {self.user}\nstores {STORES_ROLE_MAP} {REPLICATION_ROLE}\n")
            self._start(primary, timeout_s)
            self._sql(primary, f"CREATE ROLE {REPLICATION_ROLE} LOGIN REPLICATION; CREATE ROLE {self.user} LOGIN;")
            self._sql(primary, f"CREATE DATABASE {self.database} OWNER {self.user};")
            for s in self.servers[1:]:
                self._standby(s, timeout_s)
            self._await_streaming(len(self.servers) - 1, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def _start(self, s: PgServer, timeout_s: float) -> None:
        self._run([pg_bin("pg_ctl"), "-D", str(s.data), "-l", str(s.folder / "postgres.log"), "-w",
                   "-t", str(int(timeout_s)), "start"], timeout_s + 5)

    def reload(self, s: PgServer) -> None:
        """Tells a running server to read its configuration and certificate files again; OSError
        when it cannot be told (the keeper tries again)."""
        if not (s.data / "postmaster.pid").exists():
            return
        try:
            self._run([pg_bin("pg_ctl"), "-D", str(s.data), "reload"], 30)
        except RuntimeError as exc:
            raise OSError(f"PostgreSQL server {s.name} did not reload its certificate: {exc}") from None

    def cut_revoked(self, serials: frozenset[int]) -> int:
        """Ends every session, on every server, of a client whose certificate serial is in ``serials``
        (revoked since it connected: the revocation list refuses it only at the next handshake); how many."""
        if not serials:
            return 0
        listed = ",".join(str(s) for s in sorted(serials))
        ended = 0
        for s in self.servers:
            if (s.data / "postmaster.pid").exists():
                out = self._sql(s, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_ssl "
                                   f"WHERE client_serial IN ({listed})")
                ended += int(out.strip() or 0)
        return ended

    def _sql(self, s: PgServer, sql: str) -> str:
        """``sql`` run by the server's superuser over its Unix socket."""
        return self._run([pg_bin("psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", str(s.folder),
                          "-p", str(s.port), "-d", "postgres", "-c", sql])

    def _standby(self, s: PgServer, timeout_s: float) -> None:
        """A standby from a base backup of the primary, streaming from it (``-R``)."""
        self._run([pg_bin("pg_basebackup"), "-D", str(s.data), "-R", "-X", "stream", "-c", "fast",
                   "-d", self._conninfo(self.servers[0], s)], timeout_s)
        with open(s.data / "postgresql.conf", "a") as f:
            f.write(self._conf(s))
        self._start(s, timeout_s)

    def _await_streaming(self, n: int, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while True:
            got = int(self._sql(self.servers[0], "SELECT count(*) FROM pg_stat_replication "
                                                 "WHERE state = 'streaming'").strip() or 0)
            if got >= n:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"{got} of {n} PostgreSQL standbys streaming after {timeout_s:g} s")
            time.sleep(0.2)

    def replayed(self, index: int, sql: str) -> str:
        """``sql``'s answer on server ``index`` (a standby answers read-only queries)."""
        s = self.servers[index]
        return self._run([pg_bin("psql"), "-X", "-q", "-A", "-t", "-h", str(s.folder), "-p", str(s.port),
                          "-d", self.database, "-c", sql]).strip()

    def stop(self) -> None:
        """Stops every server (fast shutdown) and removes their folder."""
        for s in reversed(self.servers):
            if (s.data / "postmaster.pid").exists():
                try:
                    self._run([pg_bin("pg_ctl"), "-D", str(s.data), "-m", "fast", "-w", "-t", "20", "stop"], 30)
                except RuntimeError:
                    pass  # already gone
        shutil.rmtree(self.root, ignore_errors=True)
