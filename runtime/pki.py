"""The cluster's public-key infrastructure: a CA, and certificates that bind
a component's role, site and name.

Every certificate carries its identity as a URI subject alternative name,
``kvrelay://<site>/<role>/<name>``, plus DNS names that TLS hostname checks
can pin: ``<name>.<role>.<site>.kvrelay`` (exactly this component) and
``<role>.kvrelay`` (any component of the role). A channel to a worker pins
the first, a channel to the router the second, so a certificate for one
worker can never stand in for another, whatever address it answers on.

Keys are ECDSA P-256; certificates are short-lived (30 days by default).
Every problem with a file (missing, unreadable, not PEM, expired, not yet
valid, issued by another CA, key that does not match) raises
:class:`PKIError` naming the file and the problem."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvrelay.runtime.files import write_private

CA_CERT, CA_KEY = "ca.pem", "ca.key"
"""File names of the CA inside a PKI folder (``kvrelay pki init DIR``)."""
DEFAULT_CERT_DAYS = 30.0
CA_DAYS = 3650.0
_PART = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
"""Sites and names: lowercase, because TLS host names match without case (``W1`` would pin as ``w1``)."""
_URI = re.compile(r"kvrelay://([^/]+)/([^/]+)/([^/]+)")


class PKIError(ValueError):
    """A certificate or key that cannot be used, and why."""


class CertRole(StrEnum):
    """What a certificate lets its holder be."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"
    OPERATOR = "operator"
    """Scales pools, drains workers, lists workers (``kvrelay status``)."""
    CLIENT = "client"
    """A tenant: the certificate's name is the tenant's name."""
    NODE = "node"
    """A Ray node's TLS certificate (``RAY_TLS_SERVER_CERT``): it carries Ray's
    control channel between nodes, and no kvrelay listener admits it."""
    ETCD = "etcd"
    """A member of the routers' etcd (client and peer TLS); no kvrelay listener admits it."""
    STORE = "store"
    """A server of the routers' job database (PostgreSQL: its TLS, and a standby's replication
    connection); no kvrelay listener admits it."""

    @property
    def is_server(self) -> bool:
        """Components that accept connections (and make them)."""
        return self in (CertRole.ROUTER, CertRole.PREFILL, CertRole.DECODE)

    @property
    def serves_tls(self) -> bool:
        """Certificates that a TLS server presents (a kvrelay component or a Ray node)."""
        return self.is_server or self in (CertRole.NODE, CertRole.ETCD, CertRole.STORE)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a certificate names."""

    site: str
    role: CertRole
    name: str

    def __post_init__(self) -> None:
        if not _PART.fullmatch(self.site):
            raise PKIError(f"site {self.site!r} must be lowercase letters, digits, - or _")
        if not _PART.fullmatch(self.name):
            raise PKIError(f"name {self.name!r} must be lowercase letters, digits, - or _ (at most 63)")

    @property
    def uri(self) -> str:
        return f"kvrelay://{self.site}/{self.role}/{self.name}"

    @property
    def dns(self) -> str:
        """The DNS name that pins exactly this component."""
        return f"{self.name}.{self.role}.{self.site}.kvrelay"

    @property
    def path(self) -> str:
        """``site/role/name``: a worker's id."""
        return f"{self.site}/{self.role}/{self.name}"

    def __str__(self) -> str:
        return self.uri

    @classmethod
    def parse(cls, uri: str) -> Identity | None:
        """The identity a ``kvrelay://`` URI names; None when it names none."""
        m = _URI.fullmatch(uri)
        if m is None or m.group(2) not in set(CertRole):
            return None
        try:
            return cls(m.group(1), CertRole(m.group(2)), m.group(3))
        except PKIError:
            return None


def role_dns(role: CertRole) -> str:
    """The DNS name every certificate of ``role`` carries."""
    return f"{role}.kvrelay"


@dataclass(frozen=True, slots=True)
class CertInfo:
    """What ``kvrelay pki show`` prints about a certificate."""

    identity: Identity | None
    serial: int
    not_before: dt.datetime
    not_after: dt.datetime
    subject: str
    issuer: str
    hosts: tuple[str, ...]
    """Other DNS names and IP addresses the certificate is valid for."""
    is_ca: bool

    @property
    def serial_hex(self) -> str:
        return format(self.serial, "x")


@dataclass(slots=True)
class CA:
    """A CA certificate and its key: what issues certificates."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def crl_pem(ca: CA, serials: Iterable[int], days: float) -> bytes:
    """A certificate revocation list of ``ca`` naming ``serials`` (PEM), valid ``days``: what
    servers kvrelay does not write itself (etcd, PostgreSQL) refuse certificates by."""
    now = _now()
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.cert.subject)
               .last_update(now - dt.timedelta(minutes=5)).next_update(now + dt.timedelta(days=days)))
    for serial in sorted(serials):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
    return builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def new_ca(common_name: str = "kvrelay cluster CA", days: float = CA_DAYS) -> CA:
    """A new self-signed CA that may sign leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return CA(cert, key)


def _sans(identity: Identity, hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    if identity.role.is_server or identity.role in (CertRole.ETCD, CertRole.STORE):
        names += [x509.DNSName(identity.dns), x509.DNSName(role_dns(identity.role))]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def issue(ca: CA, identity: Identity, days: float = DEFAULT_CERT_DAYS,
          hosts: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    """A certificate for ``identity`` signed by ``ca`` and its new key, as
    PEM (certificate, key). ``hosts``: DNS names or IP addresses clients
    reach the component by (the router's public listeners)."""
    if days <= 0:
        raise PKIError(f"certificate lifetime must be positive, got {days} days")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if identity.role.serves_tls:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.path)]))
            .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=days), ca.cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_sans(identity, hosts)), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def read_pem(path: str | Path, what: str) -> bytes:
    """The bytes of ``path``; PKIError naming ``what`` and the file when it is missing or unreadable."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise PKIError(f"{what} {path}: file not found") from None
    except OSError as exc:
        raise PKIError(f"{what} {path}: cannot read ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise PKIError(f"{what} {path}: not a PEM file")
    return data


def load_cert(pem: bytes, where: str) -> x509.Certificate:
    """The first certificate of ``pem``; PKIError naming ``where`` when there is none."""
    try:
        return x509.load_pem_x509_certificates(pem)[0]
    except ValueError as exc:
        raise PKIError(f"{where}: not a PEM certificate ({exc})") from None


def load_key(pem: bytes, where: str) -> ec.EllipticCurvePrivateKey:
    """The private key in ``pem``; PKIError naming ``where`` when it is not an EC key."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise PKIError(f"{where}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PKIError(f"{where}: expected an EC private key (kvrelay pki issues P-256 keys)")
    return key


def identity_of(cert: x509.Certificate) -> Identity | None:
    """The kvrelay identity a certificate names (its URI SAN), or None."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        ident = Identity.parse(uri)
        if ident is not None:
            return ident
    return None


def cert_info(cert: x509.Certificate) -> CertInfo:
    """The facts ``kvrelay pki show`` prints."""
    hosts: list[str] = []
    is_ca = False
    for ext in cert.extensions:
        if isinstance(ext.value, x509.SubjectAlternativeName):
            hosts = [d for d in ext.value.get_values_for_type(x509.DNSName) if not d.endswith(".kvrelay")]
            hosts += [str(ip) for ip in ext.value.get_values_for_type(x509.IPAddress)]
        elif isinstance(ext.value, x509.BasicConstraints):
            is_ca = ext.value.ca
    return CertInfo(identity_of(cert), cert.serial_number, cert.not_valid_before_utc, cert.not_valid_after_utc,
                    cert.subject.rfc4514_string(), cert.issuer.rfc4514_string(), tuple(hosts), is_ca)


def check_validity(cert: x509.Certificate, where: str, now: dt.datetime | None = None) -> None:
    """PKIError when ``cert`` is expired or not yet valid."""
    now = now or _now()
    if now > cert.not_valid_after_utc:
        raise PKIError(f"{where}: certificate expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC "
                       "(issue a new one: kvrelay pki issue)")
    if now < cert.not_valid_before_utc:
        raise PKIError(f"{where}: certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC "
                       "(is this machine's clock right?)")


def check_issued_by(cert: x509.Certificate, cas: list[x509.Certificate], where: str) -> None:
    """PKIError unless one of ``cas`` signed ``cert``."""
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return
        except (ValueError, TypeError, InvalidSignature):
            continue
    raise PKIError(f"{where}: certificate was not issued by the cluster CA (issuer {cert.issuer.rfc4514_string()}; "
                   f"CA {', '.join(c.subject.rfc4514_string() for c in cas) or 'none'})")


def load_ca_bundle(pem: bytes, where: str) -> list[x509.Certificate]:
    """The CA certificates of a bundle, each checked to be a valid CA."""
    try:
        cas = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise PKIError(f"{where}: not a PEM certificate bundle ({exc})") from None
    for ca in cas:
        if not cert_info(ca).is_ca:
            raise PKIError(f"{where}: {ca.subject.rfc4514_string()} is not a CA certificate")
        check_validity(ca, where)
    return cas


def check_pair(cert_pem: bytes, key_pem: bytes, ca_pem: bytes, where: str) -> CertInfo:
    """Checks that a certificate can be used now: valid dates, issued by the
    CA in ``ca_pem``, matched by its key, naming a kvrelay identity."""
    cert = load_cert(cert_pem, where)
    check_validity(cert, where)
    check_issued_by(cert, load_ca_bundle(ca_pem, f"{where} (CA bundle)"), where)
    if load_key(key_pem, f"{where} (key)").public_key() != cert.public_key():
        raise PKIError(f"{where}: the key does not belong to the certificate")
    info = cert_info(cert)
    if info.identity is None:
        raise PKIError(f"{where}: the certificate names no kvrelay identity (no kvrelay:// URI)")
    return info


def init_ca_dir(folder: Path, days: float = CA_DAYS) -> CA:
    """Creates a CA in ``folder`` (``ca.pem``, ``ca.key``); PKIError when one is there already."""
    if (folder / CA_CERT).exists() or (folder / CA_KEY).exists():
        raise PKIError(f"{folder}: a CA exists there already (remove it first to make a new one)")
    ca = new_ca(days=days)
    write_private(folder / CA_KEY, _key_pem(ca.key))
    write_private(folder / CA_CERT, ca.pem)
    return ca


def load_ca(cert_path: Path, key_path: Path) -> CA:
    """The CA whose key is in ``key_path`` and whose certificate is in ``cert_path`` (a bundle
    during a CA rotation: the certificate the key belongs to is the signing one)."""
    bundle = read_pem(cert_path, "CA certificate")
    key = load_key(read_pem(key_path, "CA key"), str(key_path))
    try:
        certs = x509.load_pem_x509_certificates(bundle)
    except ValueError as exc:
        raise PKIError(f"{cert_path}: not a PEM certificate bundle ({exc})") from None
    cert = next((c for c in certs if c.public_key() == key.public_key()), None)
    if cert is None:
        raise PKIError(f"{key_path}: the key does not belong to the CA certificate {cert_path}")
    check_validity(cert, str(cert_path))
    return CA(cert, key)


ROTATION = "rotation.json"
"""A CA folder's record of a rotation in progress."""
NEXT_KEY = "ca-next.key"
"""The new CA's key while the old one still issues (a rotation's first step)."""
MIN_TRUST_S = 15.0
"""The least time between a rotation's first step and its second: every process that follows
``ca.pem`` looks at it again within that (each looks every 2 s, a launcher too)."""


class RotationStep(StrEnum):
    """Where a CA rotation stands (``kvrelay pki rotate-ca``)."""

    TRUSTING = "trusting"
    """Both CAs trusted; the old one still issues (clients and processes learn the new one)."""
    ISSUING = "issuing"
    """Both trusted; the new one issues (certificates of the old one are replaced)."""


@dataclass(frozen=True, slots=True)
class Rotation:
    """A CA rotation in a folder, in three steps so that no certificate is ever presented to a
    peer that does not trust its CA yet: the new CA trusted beside the old (``ca.pem`` holds
    both; the old key still issues), then issuing with the new (the next look at ``ca.key``), then,
    after ``overlap_days``, the old one dropped from ``ca.pem``."""

    step: RotationStep
    new_serial: int
    old_serials: tuple[int, ...]
    since: dt.datetime
    """When this step began."""
    overlap_days: float

    @property
    def until(self) -> dt.datetime:
        """When the old CA may be dropped (the overlap after the new one began issuing)."""
        return self.since + dt.timedelta(days=self.overlap_days)

    def to_json(self) -> str:
        return json.dumps({"step": self.step.value, "new": f"{self.new_serial:x}",
                           "old": [f"{s:x}" for s in self.old_serials], "since": self.since.isoformat(),
                           "overlap_days": self.overlap_days}, indent=2) + "\n"

    def write(self, folder: Path) -> None:
        write_private(folder / ROTATION, self.to_json().encode())

    @classmethod
    def read(cls, folder: Path) -> Rotation | None:
        """The rotation in progress in ``folder`` (None: none); PKIError for a record that does not parse."""
        path = folder / ROTATION
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
            return cls(RotationStep(raw["step"]), int(raw["new"], 16), tuple(int(s, 16) for s in raw["old"]),
                       dt.datetime.fromisoformat(raw["since"]), float(raw["overlap_days"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PKIError(f"{path}: not a rotation record ({exc})") from None


def rotate_ca_dir(folder: Path, overlap_days: float, days: float = CA_DAYS) -> tuple[CA, Rotation]:
    """A rotation's first step (``kvrelay pki rotate-ca``): a new CA whose certificate joins
    ``ca.pem`` after the old one's, its key kept aside (``ca-next.key``) while the old one still
    issues. PKIError when a rotation is in progress or the overlap is not positive."""
    if overlap_days <= 0:
        raise PKIError(f"the overlap must be positive, got {overlap_days:g} days")
    if Rotation.read(folder) is not None:
        raise PKIError(f"{folder}: a rotation is in progress (kvrelay pki rotate-ca --issue, then --finish)")
    load_ca(folder / CA_CERT, folder / CA_KEY)  # the folder holds a CA and its key
    kept = load_ca_bundle(read_pem(folder / CA_CERT, "CA certificate"), str(folder / CA_CERT))
    new = new_ca(days=days)
    rotation = Rotation(RotationStep.TRUSTING, new.cert.serial_number, tuple(c.serial_number for c in kept),
                        _now(), overlap_days)
    write_private(folder / NEXT_KEY, _key_pem(new.key))
    rotation.write(folder)
    write_private(folder / CA_CERT, read_pem(folder / CA_CERT, "CA certificate") + new.pem)
    return new, rotation


def issue_with_new_ca(folder: Path, force: bool = False) -> Rotation:
    """A rotation's second step (``--issue``): the new CA's key becomes ``ca.key``, so a launcher
    following the folder issues every certificate again from it; the overlap starts. PKIError
    unless the first step is done, at least :data:`MIN_TRUST_S` ago (``force``: sooner)."""
    rotation = Rotation.read(folder)
    if rotation is None or rotation.step is not RotationStep.TRUSTING:
        raise PKIError(f"{folder}: no rotation waiting to issue with its new CA (kvrelay pki rotate-ca starts one)")
    waited = (_now() - rotation.since).total_seconds()
    if not force and waited < MIN_TRUST_S:
        raise PKIError(f"the new CA was added {waited:.0f} s ago: give every process {MIN_TRUST_S:.0f} s to trust it "
                       "first (and clients their copy of ca.pem), or --force")
    new_key = read_pem(folder / NEXT_KEY, "the new CA's key")
    issuing = Rotation(RotationStep.ISSUING, rotation.new_serial, rotation.old_serials, _now(), rotation.overlap_days)
    issuing.write(folder)
    write_private(folder / CA_KEY, new_key)
    (folder / NEXT_KEY).unlink()
    load_ca(folder / CA_CERT, folder / CA_KEY)  # the new key's certificate is in the bundle
    return issuing


def finish_rotation(folder: Path, force: bool = False) -> Rotation:
    """A rotation's last step (``--finish``): ``ca.pem`` keeps only the new CA, so certificates of
    the old ones are refused from each process's next look at it. PKIError unless the new CA
    issues, or (without ``force``) before the overlap ends."""
    rotation = Rotation.read(folder)
    if rotation is None or rotation.step is not RotationStep.ISSUING:
        raise PKIError(f"{folder}: no rotation whose new CA issues (kvrelay pki rotate-ca, then --issue)")
    if not force and _now() < rotation.until:
        raise PKIError(f"the overlap lasts until {rotation.until:%Y-%m-%d %H:%M:%S} UTC: certificates of the old "
                       "CA may still be in use until then (--force ends it now)")
    ca = load_ca(folder / CA_CERT, folder / CA_KEY)
    write_private(folder / CA_CERT, ca.pem)
    (folder / ROTATION).unlink()
    return rotation
