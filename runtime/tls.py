"""TLS for every gRPC connection: a process's material (the CA it trusts,
its certificate and key, the revoked serials), the credentials servers and
channels are made from, and who the peer of a call is.

A peer's identity comes from the certificate it presented in the TLS
handshake (its ``kvrelay://`` URI), after gRPC checked that the cluster CA
issued it and that it is in date; a revoked serial is refused here."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from kvrelay.runtime.pki import (
    CertRole,
    Identity,
    PKIError,
    check_pair,
    identity_of,
    load_ca_bundle,
    load_cert,
    read_pem,
)

if TYPE_CHECKING:  # annotations only: the client commands build TLS material without the config's validation
    from kvrelay.runtime.config import ClusterConfig, TLSSection


class PeerRefused(Exception):
    """A call whose peer may not make it: ``code`` and a message saying why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RevokedSerials:
    """The certificate serials refused though the CA signed them (``tls.revoked_serials``):
    one object shared by every holder of a process's material, whose set a process may
    replace while it runs (the router, when its config file changes), so that each check
    after it refuses the new serials."""

    __slots__ = ("_serials",)

    def __init__(self, serials: frozenset[int] | set[int] = frozenset()) -> None:
        self._serials = frozenset(serials)

    def __contains__(self, serial: object) -> bool:
        return serial in self._serials

    def __bool__(self) -> bool:
        return bool(self._serials)

    def __len__(self) -> int:
        return len(self._serials)

    @property
    def serials(self) -> frozenset[int]:
        return self._serials

    def replace(self, serials: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
        """Refuses ``serials`` from now on (and no other); the serials (added, removed)."""
        old, self._serials = self._serials, frozenset(serials)
        return self._serials - old, old - self._serials


@dataclass(frozen=True, slots=True)
class TLSMaterial:
    """One process's TLS material, checked when built (:func:`load_material`)."""

    ca_pem: bytes
    """The CA bundle this process trusts (the cluster CA)."""
    cert_pem: bytes | None = None
    """This process's certificate (None: a client that presents none)."""
    key_pem: bytes | None = None
    identity: Identity | None = None
    """What ``cert_pem`` names."""
    revoked: RevokedSerials = field(default_factory=RevokedSerials)
    """Certificate serials that are refused even though the CA signed them (a frozenset given is wrapped)."""

    def __post_init__(self) -> None:
        if not isinstance(self.revoked, RevokedSerials):
            object.__setattr__(self, "revoked", RevokedSerials(self.revoked))

    def server_credentials(self, mutual: bool) -> grpc.ServerCredentials:
        """TLS for a listener; ``mutual``: clients must present a certificate from the CA."""
        if self.cert_pem is None or self.key_pem is None:
            raise PKIError("a listener needs a certificate and key (tls.cert / tls.key)")
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS for a channel: verify the server by the CA; present our certificate if we have one."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def peer(self, context: grpc.aio.ServicerContext) -> Identity | None:
        """The identity the caller's certificate names; None when it presented
        none (a server-only TLS listener); PeerRefused when it is revoked or
        names no kvrelay identity."""
        pems = context.auth_context().get("x509_pem_cert")
        return self.peer_of_pem(pems[0] if pems else None)  # type: ignore[index]  # grpc's stubs: Iterable

    def peer_of_pem(self, pem: bytes | None) -> Identity | None:
        """:meth:`peer` of a certificate a caller presented (PEM; None: none), as the HTTP API has it."""
        if not pem:
            return None
        serial, ident = _identity_of_pem(pem)
        if serial in self.revoked:
            raise PeerRefused(grpc.StatusCode.UNAUTHENTICATED,
                              f"certificate serial {serial:x} ({ident or 'no kvrelay identity'}) is revoked "
                              "(tls.revoked_serials)")
        if ident is None:
            raise PeerRefused(grpc.StatusCode.UNAUTHENTICATED, "the client certificate names no kvrelay identity")
        return ident


@functools.lru_cache(maxsize=1024)
def _identity_of_pem(pem: bytes) -> tuple[int, Identity | None]:
    cert = load_cert(pem, "peer certificate")
    return cert.serial_number, identity_of(cert)


def require_role(ident: Identity | None, roles: tuple[CertRole, ...], what: str) -> Identity:
    """``ident`` when it has one of ``roles``; PeerRefused saying what ``what`` needs otherwise."""
    wanted = " or ".join(str(r) for r in roles)
    if ident is None:
        raise PeerRefused(grpc.StatusCode.UNAUTHENTICATED,
                          f"{what} needs a {wanted} certificate from the cluster CA (mutual TLS)")
    if ident.role not in roles:
        raise PeerRefused(grpc.StatusCode.PERMISSION_DENIED,
                          f"{what} needs a {wanted} certificate; {ident} is a {ident.role}")
    return ident


def router_identity(cfg: ClusterConfig) -> Identity:
    """The one router identity this deployment's workers admit and dial (``cfg.router_uri``)."""
    ident = Identity.parse(cfg.router_uri)
    if ident is None:  # the config checks tls.router_identity's form; a site name it cannot hold ends here
        raise PKIError(f"tls.router_identity: {cfg.router_uri!r} names no kvrelay router")
    return ident


def parse_serials(serials: list[str]) -> frozenset[int]:
    """The config's revoked serials (hex, as ``kvrelay pki show`` prints them)."""
    return frozenset(int(s.replace(":", ""), 16) for s in serials)


def load_material(section: TLSSection, pem: dict[str, bytes] | None = None,
                  where: str = "tls") -> TLSMaterial | None:
    """This process's material: PEM given by the launcher (``pem``: ca, cert,
    key), else the files the config names; None when TLS is off
    (``tls.enabled: false``). PKIError naming the file for anything unusable."""
    if not section.enabled:
        return None
    pem = pem or {}
    ca_pem, cert_pem, key_pem = pem.get("ca"), pem.get("cert"), pem.get("key")
    if ca_pem is None:
        if section.ca is None:
            raise PKIError(f"{where}.ca: no CA bundle configured (kvrelay pki init makes one)")
        ca_pem = read_pem(section.ca, f"{where}.ca")
    if cert_pem is None and section.cert is not None:
        if section.key is None:  # the config requires them together
            raise PKIError(f"{where}.cert needs {where}.key")
        cert_pem = read_pem(section.cert, f"{where}.cert")
        key_pem = read_pem(section.key, f"{where}.key")
    ident = None
    if cert_pem is not None:
        if key_pem is None:
            raise PKIError(f"{where}: a certificate without its key")
        ident = check_pair(cert_pem, key_pem, ca_pem, section.cert or f"{where} certificate").identity
    else:
        load_ca_bundle(ca_pem, section.ca or f"{where}.ca")
    return TLSMaterial(ca_pem, cert_pem, key_pem, ident, RevokedSerials(parse_serials(section.revoked_serials)))
