"""A worker's certificate as the KV handshake uses it (kvtransfer.base.Credentials):
it signs our side of each handshake and checks the peer's certificate
against the cluster CA, its dates, the revocation list and the role the
peer must have (a decode worker accepts KV only from prefill workers; a
prefill worker sends only to decode workers)."""

from __future__ import annotations

import functools

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvrelay.kvtransfer.base import PeerId
from kvrelay.runtime.pki import (
    CertRole,
    check_issued_by,
    check_validity,
    identity_of,
    load_ca_bundle,
    load_cert,
    load_key,
)
from kvrelay.runtime.tls import TLSMaterial


@functools.lru_cache(maxsize=1024)
def _parse(der: bytes) -> x509.Certificate:
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise ValueError(f"not a DER certificate ({exc})") from None


class CertCredentials:
    """Credentials (kvtransfer.base) from this process's TLS material."""

    def __init__(self, tls: TLSMaterial, peer_roles: tuple[CertRole, ...]) -> None:
        """``peer_roles``: the roles a peer's certificate may have. ``tls`` is followed: a
        handshake after its renewal signs with the new key and presents the new certificate."""
        if tls.cert_pem is None or tls.key_pem is None:
            raise ValueError("KV transfer with TLS needs this worker's certificate and key")
        self._tls = tls
        self._revoked = tls.revoked
        self._roles = peer_roles
        self._loaded = -1
        self._load()

    def _load(self) -> None:
        """The material's parsed form, again after each renewal."""
        if self._loaded == self._tls.generation:
            return
        pems = self._tls.pems
        if pems.cert_pem is None or pems.key_pem is None:  # a renewal keeps both (TLSMaterial.renew)
            raise ValueError("KV transfer with TLS needs this worker's certificate and key")
        self._key = load_key(pems.key_pem, "tls.key")
        self._cas = load_ca_bundle(pems.ca_pem, "tls.ca")
        self._certificate = load_cert(pems.cert_pem, "tls.cert").public_bytes(serialization.Encoding.DER)
        self._loaded = self._tls.generation

    @property
    def certificate(self) -> bytes:
        """This worker's certificate (DER), as its handshakes present it."""
        self._load()
        return self._certificate

    def sign(self, message: bytes) -> bytes:
        self._load()
        return self._key.sign(message, ec.ECDSA(hashes.SHA256()))

    def identify(self, certificate: bytes) -> PeerId:
        cert = _parse(certificate)
        self._load()
        check_validity(cert, "certificate")
        check_issued_by(cert, self._cas, "certificate")
        ident = identity_of(cert)
        if cert.serial_number in self._revoked:
            raise ValueError(f"certificate serial {cert.serial_number:x} ({ident or 'no identity'}) is revoked")
        if ident is None:
            raise ValueError("the certificate names no kvrelay identity")
        if ident.role not in self._roles:
            wanted = " or ".join(str(r) for r in self._roles)
            raise ValueError(f"{ident} is a {ident.role}; only a {wanted} may do this")
        return PeerId(ident.site, str(ident.role), ident.name)

    def verify_signature(self, certificate: bytes, message: bytes, signature: bytes) -> None:
        key = _parse(certificate).public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ValueError("the certificate's key is not an EC key")
        try:
            key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise ValueError("bad signature") from None

    def pinned(self) -> _Pinned:
        self._load()
        return _Pinned(self._certificate, self._key, self)


class _Pinned:
    """:class:`CertCredentials` at one generation: one handshake's certificate and key."""

    __slots__ = ("_key", "_of", "certificate")

    def __init__(self, certificate: bytes, key: ec.EllipticCurvePrivateKey, of: CertCredentials) -> None:
        self.certificate, self._key, self._of = certificate, key, of

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message, ec.ECDSA(hashes.SHA256()))

    def identify(self, certificate: bytes) -> PeerId:
        return self._of.identify(certificate)

    def verify_signature(self, certificate: bytes, message: bytes, signature: bytes) -> None:
        self._of.verify_signature(certificate, message, signature)

    def pinned(self) -> _Pinned:
        return self
