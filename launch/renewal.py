"""The launcher keeps its processes' certificates fresh: each process it starts reads its
material from a folder of its own (``KVRELAY_TLS_DIR``: ``ca.pem``, ``cert.pem``, ``key.pem``,
0600 in a 0700 folder; on another node, one its Ray actor makes there and writes renewals
into) and follows it while it runs (runtime/renewal.py); the launcher issues a
new certificate into it after two thirds of the old one's life (as cert-manager does by
default), and every process's at once when the CA changes (``kvrelay pki rotate-ca`` on the
config's ``tls.ca`` / ``tls.ca_key``). Processes take the new material without a restart and
without dropping the calls they are serving."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrelay.launch.credentials import CRL_FILE, ClusterCredentials, pem_env
from kvrelay.runtime.files import private_folder, write_private
from kvrelay.runtime.kvsecret import TLS_DIR_ENV
from kvrelay.runtime.pki import Identity, PKIError, cert_info, load_cert
from kvrelay.runtime.renewal import TLS_DIR_FILES, write_material
from kvrelay.runtime.tls import Pems

log = logging.getLogger(__name__)

RENEW_AT = 2 / 3
"""The share of a certificate's life after which the launcher issues the next one."""
MAX_WAIT_S = 2.0
"""The longest the keeper sleeps between looks (it looks at the CA files then too)."""
MIN_WAIT_S = 0.2


@dataclass(slots=True)
class Kept:
    """One process's certificate as the keeper renews it."""

    ident: Identity
    hosts: tuple[str, ...]
    folder: Path | None
    """The process's folder on this machine (None: on another node, reached through ``deliver``)."""
    owner: tuple[int, int] | None = None
    """The uid and gid the process runs as, when not this launcher's (--cities)."""
    deliver: Callable[[Pems], None] | None = None
    """How a renewed certificate reaches a process on another node (its Ray actor writes it there)."""
    after: Callable[[], None] | None = None
    """What makes the process read its files again, for one that does not follow them (PostgreSQL's reload)."""
    crl: bool = False
    """The folder holds the revocation list too (crl.pem: a server kvrelay does not write, etcd, PostgreSQL)."""
    due: float = 0.0
    """When (time.time()) the next certificate is issued."""
    serial: int = 0
    """The serial of the certificate in the folder now."""


class CertKeeper:
    """Issues the certificates of a launcher's processes into their folders and renews them."""

    def __init__(self, creds: ClusterCredentials, root: Path) -> None:
        self.creds, self.root = creds, root
        self.kept: dict[str, Kept] = {}
        self.renewals = 0
        """Certificates issued again since start (tests, logs)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def issue(self, name: str, ident: Identity, hosts: tuple[str, ...] = (),
              owner: tuple[int, int] | None = None) -> dict[str, str]:
        """A new certificate for process ``name`` in its folder; the environment that names the folder."""
        folder = self.root / name.replace("/", "-")
        kept = Kept(ident, hosts, folder, owner)
        self._write(kept)
        with self._lock:
            self.kept[name] = kept
        return {TLS_DIR_ENV: str(folder)}

    def issue_files(self, name: str, ident: Identity, hosts: tuple[str, ...], folder: Path,
                    owner: tuple[int, int] | None = None, after: Callable[[], None] | None = None) -> None:
        """A new certificate for a program that reads files (etcd, PostgreSQL) in ``folder``
        (``cert.pem``, ``key.pem``, ``ca.pem``), renewed there; ``after``: run after each renewal
        (a program that reads them only when told)."""
        kept = Kept(ident, hosts, folder, owner, after=after, crl=True)
        self._write(kept)
        with self._lock:
            self.kept[name] = kept

    def issue_remote(self, name: str, ident: Identity, hosts: tuple[str, ...] = ()) -> dict[str, str]:
        """A new certificate for process ``name`` on another node, as the environment that hands it
        over (its actor writes it to a folder there); renewals go through :meth:`attach`'s ``deliver``."""
        kept = Kept(ident, hosts, None)
        env = pem_env(self._issue(kept))
        with self._lock:
            self.kept[name] = kept
        return env

    def attach(self, name: str, deliver: Callable[[Pems], None]) -> None:
        """How renewals reach process ``name`` (started after :meth:`issue_remote`)."""
        with self._lock:
            if name in self.kept:
                self.kept[name].deliver = deliver

    def forget(self, name: str) -> None:
        """No more renewals for ``name`` (it ended); its folder stays until the launcher's goes."""
        with self._lock:
            self.kept.pop(name, None)

    def _issue(self, kept: Kept) -> Pems:
        """A new certificate for ``kept`` (its serial and renewal time noted)."""
        pems = self.creds.issue_pems(kept.ident, kept.hosts)
        assert pems.cert_pem is not None  # issue_pems issues both
        info = cert_info(load_cert(pems.cert_pem, str(kept.ident)))
        now = time.time()
        kept.due = now + max(info.not_after.timestamp() - now, 0.0) * RENEW_AT
        kept.serial = info.serial
        return pems

    def _write(self, kept: Kept) -> None:
        """A new certificate to ``kept``'s process: into its folder, or through ``deliver``."""
        first = kept.serial
        pems = self._issue(kept)
        assert pems.cert_pem is not None and pems.key_pem is not None  # issue_pems issues both
        if kept.folder is None:
            if kept.deliver is None:
                raise OSError("the process has no way to take a renewed certificate yet (still starting)")
            kept.deliver(pems)
            return
        private_folder(kept.folder)
        write_material(kept.folder, pems.ca_pem, pems.cert_pem, pems.key_pem)
        if kept.crl:
            self._write_crl(kept)
        if kept.owner is not None:
            for path in (kept.folder, *(kept.folder / n for n in TLS_DIR_FILES)):
                os.chown(path, *kept.owner)
        if kept.after is not None and first:  # a renewal, not the first certificate
            kept.after()

    def _write_crl(self, kept: Kept) -> None:
        assert kept.folder is not None  # only folders of programs that read files hold one
        path = kept.folder / CRL_FILE
        write_private(path, self.creds.crl())
        if kept.owner is not None:
            os.chown(path, *kept.owner)

    def revoked_changed(self) -> list[str]:
        """The revocation list again in every server's folder (the launcher's revoked serials changed),
        each server told to read it (``after``); the names of those that could not be (logged)."""
        failed = []
        with self._lock:
            servers = [(n, k) for n, k in self.kept.items() if k.crl]
        for name, kept in servers:
            try:
                self._write_crl(kept)
                if kept.after is not None:
                    kept.after()
            except (PKIError, OSError) as exc:
                log.error("could not hand %s the new revocation list: %s", name, exc)
                failed.append(name)
        return failed

    def renew_due(self, now: float | None = None) -> list[str]:
        """Renews every certificate that is due (all of them after the CA changed); their names."""
        ca_changed = self.creds.reload()
        now = time.time() if now is None else now
        with self._lock:
            due = [(n, k) for n, k in self.kept.items() if ca_changed or k.due <= now]
        for name, kept in due:
            try:
                self._write(kept)
            except (PKIError, OSError) as exc:
                log.error("could not renew the certificate of %s: %s (trying again shortly)", name, exc)
                kept.due = now + MAX_WAIT_S
                continue
            self.renewals += 1
        if due:
            log.info("renewed %d certificate(s)%s", len(due), " (the CA changed)" if ca_changed else "")
        return [n for n, _ in due]

    def _wait_s(self) -> float:
        with self._lock:
            soonest = min((k.due for k in self.kept.values()), default=time.time() + MAX_WAIT_S)
        return min(max(soonest - time.time(), MIN_WAIT_S), MAX_WAIT_S)

    def start(self, also: Callable[[], object] | None = None) -> None:
        """Renews on a thread of its own until :meth:`stop`; ``also``: called at each look too
        (the launcher's revoked serials followed from its config file)."""
        def loop() -> None:
            while not self._stop.wait(self._wait_s()):
                self.renew_due()
                if also is not None:
                    also()
        self._thread = threading.Thread(target=loop, name="cert-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(MAX_WAIT_S + 5.0)

