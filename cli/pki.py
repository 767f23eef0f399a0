"""`kvrelay pki`: the cluster's certificates (init, issue, rotate-ca, show).

``init`` makes the cluster CA in a folder readable by this user only;
``issue`` signs a certificate for one component (its role, site and name,
see runtime/pki.py) with that CA; ``show`` prints what a certificate names,
its serial (as ``tls.revoked_serials`` takes it) and whether it is in date;
``rotate-ca`` rolls a new CA in, in three steps (trust it beside the old
one, ``--issue`` with it, ``--finish``: drop the old one after the overlap)."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from pathlib import Path

from kvrelay.runtime.pki import (
    CA,
    CA_CERT,
    CA_DAYS,
    CA_KEY,
    DEFAULT_CERT_DAYS,
    CertInfo,
    CertRole,
    Identity,
    PKIError,
    cert_info,
    check_issued_by,
    finish_rotation,
    init_ca_dir,
    issue,
    issue_with_new_ca,
    load_ca,
    load_ca_bundle,
    load_cert,
    read_pem,
    role_dns,
    rotate_ca_dir,
    write_private,
)


def _error(message: str) -> int:
    print(f"kvrelay: error: {message}", file=sys.stderr)
    return 2


def _utc(when: dt.datetime) -> str:
    return f"{when:%Y-%m-%d %H:%M:%S} UTC"


def cmd_pki_init(args: argparse.Namespace) -> int:
    """Makes the cluster CA (``ca.pem``, ``ca.key``) in ``args.dir``; exit 2 when one is there."""
    if args.days <= 0:
        return _error(f"--days must be positive, got {args.days:g}")
    folder: Path = args.dir
    try:
        ca = init_ca_dir(folder, days=args.days)
    except PKIError as exc:
        return _error(str(exc))
    print(f"kvrelay: cluster CA written to {folder / CA_CERT} (certificate) and {folder / CA_KEY} "
          "(key: keep it secret, readable by you only)")
    print(f"expires: {_utc(ca.cert.not_valid_after_utc)}")
    if folder.stat().st_mode & 0o077:
        print(f"kvrelay: warning: {folder} is open to other users (chmod 700 it)", file=sys.stderr)
    print(f"next: kvrelay pki issue --ca-dir {folder} --role ROLE --site SITE --name NAME --out DIR")
    return 0


def issuing_ca(args: argparse.Namespace, command: str = "kvrelay pki issue") -> CA:
    """The CA ``--ca-dir`` or ``--ca``/``--ca-key`` names; PKIError when neither (or both) is given."""
    if args.ca_dir is not None:
        if args.ca is not None or args.ca_key is not None:
            raise PKIError("give either --ca-dir or --ca and --ca-key, not both")
        return load_ca(args.ca_dir / CA_CERT, args.ca_dir / CA_KEY)
    if args.ca is None or args.ca_key is None:
        raise PKIError(f"{command} needs the CA that signs: --ca-dir DIR (made by kvrelay pki "
                       "init), or --ca FILE and --ca-key FILE")
    return load_ca(args.ca, args.ca_key)


def _copy_ca(ca: CA, out: Path) -> str:
    """Writes the CA certificate to ``out/ca.pem`` unless it is there; what was done, for the user."""
    path = out / CA_CERT
    if not path.exists():
        write_private(path, ca.pem)
        return f"{path} (copied)"
    try:
        same = load_cert(read_pem(path, "CA certificate"), str(path)) == ca.cert
    except PKIError:
        same = False
    if not same:
        print(f"kvrelay: warning: {path} is not the certificate of the CA that signed; left as it is",
              file=sys.stderr)
        return f"{path} (NOT the signing CA's)"
    return f"{path} (already there)"


def _stem(value: str) -> str:
    """``--stem``: a plain file name (no folder, not hidden)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", value):
        raise argparse.ArgumentTypeError(f"{value!r} must be a plain file name (letters, digits, _ . -)")
    return value


def cmd_pki_issue(args: argparse.Namespace) -> int:
    """Issues a certificate and key for one component into ``args.out``; exit 2 for bad input."""
    try:
        identity = Identity(args.site, CertRole(args.role), args.name)
        ca = issuing_ca(args)
        cert_pem, key_pem = issue(ca, identity, days=args.days, hosts=tuple(args.host or ()))
    except PKIError as exc:
        return _error(str(exc))
    out: Path = args.out
    stem = args.stem or f"{identity.role}-{identity.site}-{identity.name}"
    cert_path, key_path = out / f"{stem}.pem", out / f"{stem}.key"
    write_private(key_path, key_pem)
    write_private(cert_path, cert_pem)
    ca_note = _copy_ca(ca, out)
    info = cert_info(load_cert(cert_pem, str(cert_path)))
    print(f"certificate: {cert_path}")
    print(f"key:         {key_path} (readable by you only)")
    print(f"CA:          {ca_note}")
    print(f"identity:    {identity.uri}")
    if identity.role.is_server:
        print(f"DNS names:   {identity.dns}, {role_dns(identity.role)}")
    if info.hosts:
        print(f"hosts:       {', '.join(info.hosts)}")
    print(f"serial:      {info.serial_hex}")
    print(f"expires:     {_utc(info.not_after)}")
    return 0


def cmd_pki_rotate_ca(args: argparse.Namespace) -> int:
    """A step of a CA rotation in ``args.dir``: start it (trust a new CA), ``--issue`` (issue with
    it), ``--finish`` (trust only it); exit 2 for bad input or a step out of turn."""
    folder: Path = args.dir
    try:
        if args.issue and args.finish:
            raise PKIError("--issue and --finish are two steps: one at a time")
        if args.force and not (args.issue or args.finish):
            raise PKIError("--force goes with --issue or --finish")
        if (args.issue or args.finish) and (args.overlap_days is not None or args.days is not None):
            raise PKIError("--overlap-days and --days go with the first step (kvrelay pki rotate-ca DIR): the "
                           "rotation keeps the overlap it started with")
        if args.finish:
            done = finish_rotation(folder, force=args.force)
            print(f"kvrelay: {folder / CA_CERT} now holds only the new CA (serial {done.new_serial:x}); certificates "
                  f"of the old one ({_serials(done.old_serials)}) are refused from each process's next look at it")
            return 0
        if args.issue:
            rotation = issue_with_new_ca(folder, force=args.force)
            print(f"kvrelay: the new CA (serial {rotation.new_serial:x}) issues now: launchers following {folder} "
                  "issue every certificate again from it; renew others with kvrelay pki issue")
            print(f"both CAs stay trusted until {_utc(rotation.until)}; then: kvrelay pki rotate-ca {folder} --finish")
            return 0
        ca, rotation = rotate_ca_dir(folder, DEFAULT_CERT_DAYS if args.overlap_days is None else args.overlap_days,
                                     days=CA_DAYS if args.days is None else args.days)
    except PKIError as exc:
        return _error(str(exc))
    print(f"kvrelay: new CA (serial {ca.cert.serial_number:x}, expires {_utc(ca.cert.not_valid_after_utc)}) added to "
          f"{folder / CA_CERT} beside the old one ({_serials(rotation.old_serials)}), which still issues")
    print(f"processes that follow {folder / CA_CERT} trust both within seconds; give clients that copy of it now")
    print(f"next, once they have it: kvrelay pki rotate-ca {folder} --issue")
    return 0


def _serials(serials: tuple[int, ...]) -> str:
    return ", ".join(f"{s:x}" for s in serials)


def validity_status(info: CertInfo, now: dt.datetime | None = None) -> tuple[bool, str]:
    """(in date, status line): "valid", "EXPIRED since ...", or "not yet valid until ..."."""
    now = now or dt.datetime.now(dt.UTC)
    if now > info.not_after:
        return False, f"EXPIRED since {_utc(info.not_after)}"
    if now < info.not_before:
        return False, f"not yet valid until {_utc(info.not_before)}"
    return True, "valid"


def _print_info(info: CertInfo) -> None:
    ident = info.identity
    print(f"identity:   {ident.uri if ident else 'none'}")
    print(f"role:       {ident.role if ident else '-'}")
    print(f"site:       {ident.site if ident else '-'}")
    print(f"name:       {ident.name if ident else '-'}")
    print(f"serial:     {info.serial_hex}")
    print(f"not before: {_utc(info.not_before)}")
    print(f"not after:  {_utc(info.not_after)}")
    print(f"subject:    {info.subject}")
    print(f"issuer:     {info.issuer}")
    print(f"hosts:      {', '.join(info.hosts) or 'none'}")
    print(f"CA:         {'yes' if info.is_ca else 'no'}")


def cmd_pki_show(args: argparse.Namespace) -> int:
    """Prints a certificate; exit 0 when valid (and issued by ``--ca``), 1 when not, 2 when unreadable."""
    try:
        cert = load_cert(read_pem(args.file, "certificate"), str(args.file))
        cas = None if args.ca is None else load_ca_bundle(read_pem(args.ca, "CA bundle"), str(args.ca))
    except PKIError as exc:
        return _error(str(exc))
    info = cert_info(cert)
    _print_info(info)
    ok, status = validity_status(info)
    if cas is not None:
        try:
            check_issued_by(cert, cas, str(args.file))
            print(f"issued by:  {args.ca}: yes")
        except PKIError as exc:
            ok = False
            print(f"issued by:  {args.ca}: NO ({exc})")
    print(f"status:     {status}")
    return 0 if ok else 1


def add_parsers(sub) -> None:
    """``kvrelay pki init | issue | rotate-ca | show``."""
    pki = sub.add_parser("pki", help="the cluster CA and component certificates").add_subparsers(
        dest="pki_command", required=True)
    init = pki.add_parser("init", help="make the cluster CA in a folder (ca.pem, ca.key)")
    init.add_argument("dir", type=Path, help="folder for ca.pem and ca.key (made readable by you only)")
    init.add_argument("--days", type=float, default=CA_DAYS, help="CA lifetime in days (default: %(default)g)")
    init.set_defaults(func=cmd_pki_init)

    iss = pki.add_parser("issue", help="issue a certificate for a router, worker, operator or client")
    iss.add_argument("--role", required=True, choices=[r.value for r in CertRole])
    iss.add_argument("--site", required=True, help="site name (lowercase letters, digits, - or _)")
    iss.add_argument("--name", required=True, help="component name, e.g. 1 (a worker), or the tenant's name")
    iss.add_argument("--out", required=True, type=Path, help="folder for <role>-<site>-<name>.pem/.key")
    iss.add_argument("--stem", type=_stem, help="name the files STEM.pem and STEM.key instead "
                     "(a pod's init container: one path in the config for every pod)")
    iss.add_argument("--ca-dir", type=Path, help="the CA folder made by kvrelay pki init")
    iss.add_argument("--ca", type=Path, help="CA certificate (instead of --ca-dir)")
    iss.add_argument("--ca-key", type=Path, help="CA key (instead of --ca-dir)")
    iss.add_argument("--days", type=float, default=DEFAULT_CERT_DAYS,
                     help="certificate lifetime in days (default: %(default)g)")
    iss.add_argument("--host", action="append", metavar="H",
                     help="DNS name or IP address the component is reached by (repeatable)")
    iss.set_defaults(func=cmd_pki_issue)

    rot = pki.add_parser("rotate-ca", help="roll a new CA in: trust it, issue with it, then drop the old one")
    rot.add_argument("dir", type=Path, help="the CA folder made by kvrelay pki init")
    rot.add_argument("--overlap-days", type=float,
                     help=f"how long both CAs stay trusted once the new one issues (default: {DEFAULT_CERT_DAYS:g}, a "
                          "certificate's lifetime)")
    rot.add_argument("--days", type=float, help=f"the new CA's lifetime (default: {CA_DAYS:g})")
    rot.add_argument("--issue", action="store_true", help="step 2: issue with the new CA (the overlap starts)")
    rot.add_argument("--finish", action="store_true", help="step 3, after the overlap: trust only the new CA")
    rot.add_argument("--force", action="store_true", help="with --issue or --finish: sooner than they allow")
    rot.set_defaults(func=cmd_pki_rotate_ca)

    show = pki.add_parser("show", help="print a certificate's identity, serial and validity")
    show.add_argument("file", type=Path, help="certificate (PEM)")
    show.add_argument("--ca", type=Path, help="also check that this CA (bundle) issued it")
    show.set_defaults(func=cmd_pki_show)

