"""The credentials a launcher hands the processes it starts: a certificate
per process from the cluster CA (the router's names its hosts; a worker's
names exactly its site, role and index), the KV secret, and the tokens of
this run.

The local default needs no setup: :func:`ensure_local_ca` and
:func:`ensure_client_token` make a per-user CA and a client token under the
cache folder on first use (folders 0700, files 0600) and reuse them after;
`kvrelay generate`, `status` and the other commands find them there."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.router.governance.audit_heads import generate_signing_key
from kvrelay.runtime.kvsecret import TLS_ENV
from kvrelay.runtime.pki import (
    CA,
    CA_CERT,
    CA_KEY,
    Identity,
    PKIError,
    init_ca_dir,
    issue,
    load_ca,
    write_private,
)
from kvrelay.runtime.tls import RevokedSerials, TLSMaterial, parse_serials

if TYPE_CHECKING:  # annotations only: the client commands import this module without the config's validation
    from kvrelay.runtime.config import TLSSection

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


class ClusterCredentials:
    """Issues each process of one cluster its TLS material."""

    def __init__(self, ca: CA, tls: TLSSection) -> None:
        self.ca = ca
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
        return cls(load_ca(Path(tls.ca), Path(tls.ca_key)), tls)

    @property
    def ca_pem(self) -> bytes:
        return self.ca.pem

    def material(self, ident: Identity, hosts: tuple[str, ...] = ()) -> TLSMaterial:
        """A new certificate for ``ident`` (valid for ``hosts`` too), as a process uses it."""
        cert, key = issue(self.ca, ident, self.days, hosts)
        return TLSMaterial(self.ca.pem, cert, key, ident, RevokedSerials(self.revoked))

    def write_files(self, ident: Identity, hosts: tuple[str, ...], folder: Path) -> None:
        """A new certificate for ``ident`` in ``folder`` as cert.pem, key.pem and ca.pem (0600), for a
        program that reads files (etcd, PostgreSQL)."""
        mat = self.material(ident, hosts)
        if mat.cert_pem is None or mat.key_pem is None:  # material() issues both
            raise RuntimeError(f"no certificate and key were issued for {ident}")
        write_private(folder / "cert.pem", mat.cert_pem)
        write_private(folder / "key.pem", mat.key_pem)
        write_private(folder / "ca.pem", mat.ca_pem)

    def env(self, ident: Identity, hosts: tuple[str, ...] = ()) -> dict[str, str]:
        """The environment that hands a child process its certificate."""
        mat = self.material(ident, hosts)
        if mat.cert_pem is None or mat.key_pem is None:  # material() issues both
            raise RuntimeError(f"no certificate and key were issued for {ident}")
        return {TLS_ENV["ca"]: mat.ca_pem.decode(), TLS_ENV["cert"]: mat.cert_pem.decode(),
                TLS_ENV["key"]: mat.key_pem.decode()}

    def client(self) -> TLSMaterial:
        """What a client that presents no certificate needs: the CA."""
        return TLSMaterial(self.ca.pem, revoked=RevokedSerials(self.revoked))

