"""The credentials a launcher hands the processes it starts: a certificate
per process from the cluster CA (the router's names its hosts; a worker's
names exactly its site, role and index), the KV secret, and the tokens of
this run.

The local default needs no setup: :func:`ensure_local_ca` and
:func:`ensure_client_token` make a per-user CA and a client token under the
cache folder on first use (folders 0700, files 0600) and reuse them after;
`kvrelay generate`, `status` and the other commands find them there."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.router.governance.audit_heads import generate_signing_key
from kvrelay.runtime.files import file_stamp
from kvrelay.runtime.kvsecret import TLS_ENV
from kvrelay.runtime.pki import (
    CA,
    CA_CERT,
    CA_KEY,
    Identity,
    PKIError,
    crl_pem,
    init_ca_dir,
    issue,
    load_ca,
    load_ca_bundle,
    read_pem,
    write_private,
)
from kvrelay.runtime.tls import Pems, RevokedSerials, TLSMaterial, parse_serials

if TYPE_CHECKING:  # annotations only: the client commands import this module without the config's validation
    from kvrelay.runtime.config import TLSSection

log = logging.getLogger(__name__)

LOCAL_PKI = "pki"
"""Folder of the per-user CA inside the cache folder."""
CLIENT_TOKEN = "client-token"
"""File (in the cache folder) of the local default's client token (tenant ``local``)."""
LOCAL_TENANT = "local"
AUDIT_KEY = "audit-signing.key"
"""The audit log's signing key, made by the launcher in a ``keys`` folder beside the log (its public key: ``.pub``)."""


def _private_cache(cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    cache_dir.chmod(0o700)  # it holds the jobs database (prompts and outputs) and the tokens too


def ensure_local_ca(cache_dir: Path) -> tuple[Path, Path]:
    """The per-user CA under ``cache_dir`` (certificate, key), made on first use."""
    _private_cache(cache_dir)
    folder = cache_dir / LOCAL_PKI
    if not (folder / CA_CERT).exists():
        init_ca_dir(folder)
    return folder / CA_CERT, folder / CA_KEY


def ensure_audit_key(folder: Path) -> Path:
    """The audit log's Ed25519 signing key in ``folder`` (0700; key 0600, public key
    ``<key>.pub`` beside it for `kvrelay audit verify --key`), made on first use."""
    key = folder / AUDIT_KEY
    if not key.exists():
        generate_signing_key(key)
    return key


def ensure_client_token(cache_dir: Path) -> str:
    """The per-user tenant token under ``cache_dir``, made on first use."""
    _private_cache(cache_dir)
    token_file = cache_dir / CLIENT_TOKEN
    if not token_file.exists():
        write_private(token_file, (secrets.token_urlsafe(32) + "\n").encode())
    return token_file.read_text().strip()


def pem_env(pems: Pems) -> dict[str, str]:
    """The environment variables that hand a process ``pems`` (:data:`~runtime.kvsecret.TLS_ENV`)."""
    if pems.cert_pem is None or pems.key_pem is None:
        raise PKIError("a process needs a certificate and key, not only the CA")
    return {TLS_ENV["ca"]: pems.ca_pem.decode(), TLS_ENV["cert"]: pems.cert_pem.decode(),
            TLS_ENV["key"]: pems.key_pem.decode()}


CRL_FILE = "crl.pem"
"""The revocation list beside cert.pem, key.pem and ca.pem in a server's folder (etcd, PostgreSQL)."""
CRL_LIFE = 2.0
"""A revocation list's validity, in certificate lifetimes (servers refuse every client once it expires)."""


class ClusterCredentials:
    """Issues each process of one cluster its TLS material. With the config's CA (``tls.ca``
    and ``tls.ca_key``), :meth:`reload` follows those files: after ``kvrelay pki rotate-ca`` the
    new CA issues and the bundle (new and old) is what processes trust."""

    def __init__(self, ca: CA, tls: TLSSection, bundle: bytes | None = None,
                 files: tuple[Path, Path] | None = None) -> None:
        self.ca = ca
        self.bundle = bundle or ca.pem
        """The CA certificates processes trust (during a rotation, the new CA's and the old)."""
        self.files = files
        """The CA's certificate (bundle) and key files, when the config names them."""
        self._stamps = self._stamp()
        self.days = tls.cert_days
        self.revoked = parse_serials(tls.revoked_serials)

    @classmethod
    def for_config(cls, tls: TLSSection, scratch: Path) -> ClusterCredentials | None:
        """The CA the config names (``tls.ca`` with ``tls.ca_key``), or a new
        one in ``scratch`` for this cluster's life; None when TLS is off.
        PKIError when the config names a CA without its key."""
        if not tls.enabled:
            return None
        if tls.ca is None:
            init_ca_dir(scratch)
            return cls(load_ca(scratch / CA_CERT, scratch / CA_KEY), tls)
        if tls.ca_key is None:
            raise PKIError("tls.ca_key: the launcher issues each process its certificate, so it needs the CA's key "
                           "(or start each process yourself, each with a config whose tls.cert/tls.key are its own)")
        files = (Path(tls.ca), Path(tls.ca_key))
        return cls(load_ca(*files), tls, read_pem(files[0], "tls.ca"), files)

    def _stamp(self) -> list | None:
        return [file_stamp(p) for p in self.files] if self.files is not None else None

    def reload(self) -> bool:
        """True when the CA files changed and now load (the new CA issues from now on); a change
        that does not load is logged and changes nothing."""
        stamps = self._stamp()
        if self.files is None or stamps == self._stamps or None in (stamps or ()):
            return False
        try:
            ca, bundle = load_ca(*self.files), read_pem(self.files[0], "tls.ca")
            load_ca_bundle(bundle, str(self.files[0]))
        except PKIError as exc:
            log.warning("the CA files changed but cannot be used (%s): issuing with the CA as it was", exc)
            return False
        self._stamps = stamps
        changed = ca.cert != self.ca.cert or bundle != self.bundle
        self.ca, self.bundle = ca, bundle
        return changed

    @property
    def ca_pem(self) -> bytes:
        """The CA bundle processes trust."""
        return self.bundle

    def issue_pems(self, ident: Identity, hosts: tuple[str, ...] = ()) -> Pems:
        """A new certificate and key for ``ident`` (valid for ``hosts`` too), with the bundle."""
        cert, key = issue(self.ca, ident, self.days, hosts)
        return Pems(self.bundle, cert, key, ident)

    def material(self, ident: Identity, hosts: tuple[str, ...] = ()) -> TLSMaterial:
        """A new certificate for ``ident`` (valid for ``hosts`` too), as a process uses it."""
        pems = self.issue_pems(ident, hosts)
        return TLSMaterial(pems.ca_pem, pems.cert_pem, pems.key_pem, ident, RevokedSerials(self.revoked))

    def write_files(self, ident: Identity, hosts: tuple[str, ...], folder: Path) -> None:
        """A new certificate for ``ident`` in ``folder`` as cert.pem, key.pem and ca.pem (0600), and the
        revocation list as crl.pem, for a program that reads files (etcd, PostgreSQL)."""
        mat = self.material(ident, hosts)
        if mat.cert_pem is None or mat.key_pem is None:  # material() issues both
            raise RuntimeError(f"no certificate and key were issued for {ident}")
        write_private(folder / "cert.pem", mat.cert_pem)
        write_private(folder / "key.pem", mat.key_pem)
        write_private(folder / "ca.pem", mat.ca_pem)
        write_private(folder / CRL_FILE, self.crl())

    def crl(self) -> bytes:
        """The issuing CA's revocation list of the revoked serials (PEM), valid CRL_LIFE certificate
        lifetimes: a server's certificate is renewed, and its crl.pem with it, well before it ends."""
        return crl_pem(self.ca, self.revoked, self.days * CRL_LIFE)

    def env(self, ident: Identity, hosts: tuple[str, ...] = ()) -> dict[str, str]:
        """The environment that hands a child process a new certificate (not renewed: see launch/renewal.py)."""
        return pem_env(self.issue_pems(ident, hosts))

    def client(self) -> TLSMaterial:
        """What a client that presents no certificate needs: the CA."""
        return TLSMaterial(self.bundle, revoked=RevokedSerials(self.revoked))

