"""TLS for every gRPC connection: a process's material (the CA it trusts,
its certificate and key, the revoked serials), the credentials servers and
channels are made from, and who the peer of a call is.

A peer's identity comes from the certificate it presented in the TLS
handshake (its ``kvrelay://`` URI), after gRPC checked that the cluster CA
issued it and that it is in date; a revoked serial is refused here."""

from __future__ import annotations

import functools
from dataclasses import dataclass
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
class Pems:
    """One generation of a process's TLS material (checked by whoever made it)."""

    ca_pem: bytes
    """The CA bundle trusted (during a CA rotation, the new CA and the old)."""
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    identity: Identity | None = None


class TLSMaterial:
    """One process's TLS material, checked when built (:func:`load_material`), which the
    process may renew while it runs (:meth:`renew`: a new certificate for the same identity,
    a new CA bundle): each listener's next handshake, each channel made after it and each KV
    handshake use the new material; connections already made go on with theirs."""

    __slots__ = ("_pems", "generation", "revoked")

    def __init__(self, ca_pem: bytes, cert_pem: bytes | None = None, key_pem: bytes | None = None,
                 identity: Identity | None = None,
                 revoked: RevokedSerials | frozenset[int] | set[int] | None = None) -> None:
        self._pems = Pems(ca_pem, cert_pem, key_pem, identity)
        self.generation = 0
        """How many times the material was renewed."""
        self.revoked = revoked if isinstance(revoked, RevokedSerials) else RevokedSerials(revoked or frozenset())
        """Certificate serials that are refused even though the CA signed them."""

    @property
    def pems(self) -> Pems:
        return self._pems

    @property
    def ca_pem(self) -> bytes:
        """The CA bundle this process trusts (the cluster CA)."""
        return self._pems.ca_pem

    @property
    def cert_pem(self) -> bytes | None:
        """This process's certificate (None: a client that presents none)."""
        return self._pems.cert_pem

    @property
    def key_pem(self) -> bytes | None:
        return self._pems.key_pem

    @property
    def identity(self) -> Identity | None:
        """What ``cert_pem`` names (the same for the process's life)."""
        return self._pems.identity

    def renew(self, pems: Pems) -> None:
        """Uses ``pems`` from now on: PKIError when they name another identity (a process's
        identity never changes) or drop the certificate."""
        if pems.identity != self.identity:
            raise PKIError(f"a renewed certificate must name {self.identity or 'no identity'}, "
                           f"not {pems.identity or 'no identity'}")
        if (pems.cert_pem is None) != (self.cert_pem is None):
            raise PKIError("a renewal must keep a certificate and key (or keep having none)")
        self._pems = pems
        self.generation += 1

    def _server_config(self):
        pems = self._pems
        if pems.cert_pem is None or pems.key_pem is None:
            raise PKIError("a listener needs a certificate and key (tls.cert / tls.key)")
        return grpc.ssl_server_certificate_configuration([(pems.key_pem, pems.cert_pem)],
                                                         root_certificates=pems.ca_pem)

    def server_credentials(self, mutual: bool) -> grpc.ServerCredentials:
        """TLS for a listener; ``mutual``: clients must present a certificate from the CA.
        Each handshake takes the material current then (gRPC asks before each one)."""
        initial = self._server_config()
        served = [self.generation]

        def current():  # called by gRPC before every handshake: None keeps the last configuration
            if self.generation == served[0]:
                return None
            served[0] = self.generation
            return self._server_config()
        return grpc.dynamic_ssl_server_credentials(initial, current, require_client_authentication=mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS for a channel: verify the server by the CA; present our certificate if we have one
        (the material current now: a channel made before a renewal keeps what it had)."""
        pems = self._pems
        return grpc.ssl_channel_credentials(root_certificates=pems.ca_pem, private_key=pems.key_pem,
                                            certificate_chain=pems.cert_pem)

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
    pems = check_pems(ca_pem, cert_pem, key_pem, section.cert or f"{where} certificate", section.ca or f"{where}.ca")
    return TLSMaterial(pems.ca_pem, pems.cert_pem, pems.key_pem, pems.identity,
                       RevokedSerials(parse_serials(section.revoked_serials)))


def check_pems(ca_pem: bytes, cert_pem: bytes | None, key_pem: bytes | None, where: str,
               ca_where: str) -> Pems:
    """Material that can be used now (the pair in date, issued by the bundle, matched by its
    key, naming an identity); PKIError naming ``where`` (or ``ca_where``) otherwise."""
    if cert_pem is None:
        load_ca_bundle(ca_pem, ca_where)
        return Pems(ca_pem)
    if key_pem is None:
        raise PKIError(f"{where}: a certificate without its key")
    return Pems(ca_pem, cert_pem, key_pem, check_pair(cert_pem, key_pem, ca_pem, where).identity)
