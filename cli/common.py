"""Helpers the `kvrelay` command modules share: flags, credentials, channels,
errors and tables. Light on purpose: it imports neither torch nor the engine
(the client commands start in a fraction of a second); what runs a model or a
replay is in cli/replay_run.py and cli/local.py."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from kvrelay.cli.login import OIDC_TOKEN, Bound, cached_token
from kvrelay.launch.credentials import CLIENT_TOKEN, LOCAL_PKI
from kvrelay.runtime.files import write_private
from kvrelay.runtime.pki import CA_CERT, PKIError, check_pair, read_pem
from kvrelay.runtime.rpc import Dialer
from kvrelay.runtime.tls import RevokedSerials, TLSMaterial, parse_serials
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc


def default_cache_dir() -> Path:
    """``$KVRELAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrelay``, else ``~/.cache/kvrelay``."""
    if os.environ.get("KVRELAY_CACHE_DIR"):
        return Path(os.environ["KVRELAY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvrelay"


def add_connect_flags(p: argparse.ArgumentParser, router_default: str | None = "127.0.0.1:50051") -> None:
    """How a command reaches the router: address, CA, optional certificate."""
    p.add_argument("--router", default=router_default,
                   help="router address (the public port; with --cert, its internal port); several, comma-"
                        "separated: the first that answers among those that read this tenant's prompts "
                        "(kvrelay routers)" + (" (default: %(default)s)" if router_default else ""))
    p.add_argument("--ca", type=Path, help="CA bundle the router's certificate must come from "
                                           "(default: the local one kvrelay serve made, <cache-dir>/pki/ca.pem)")
    p.add_argument("--cert", type=Path, help="present this client or operator certificate instead of a token "
                                             "(kvrelay pki issue; needs --key and the router's internal port)")
    p.add_argument("--key", type=Path, help="the key of --cert")
    p.add_argument("--plaintext", action="store_true",
                   help="no TLS: only for a router started with tls.enabled: false (loopback)")
    p.add_argument("--revoked", default="", metavar="SERIALS",
                   help="certificate serials to refuse the router by, comma-separated hex as `kvrelay pki show` "
                        "prints them (the cluster's tls.revoked_serials)")


def client_token(args: argparse.Namespace) -> str | None:
    """The tenant token: $KVRELAY_API_KEY; else, for the local default (no ``--ca``: its CA and
    token are in the cache folder, where `kvrelay serve` wrote them), the local token; else the
    OpenID token `kvrelay login` cached for these routers and this CA (refreshed when about to
    expire; LoginError if it was cached for others), else the local token.
    So a researcher signed in to an institution's cluster (named with ``--ca``) keeps using the
    local default as before."""
    token = os.environ.get("KVRELAY_API_KEY", "")
    if token:
        return token
    local_file = args.cache_dir / CLIENT_TOKEN
    local = local_file.read_text().strip() if local_file.exists() else ""
    if local and getattr(args, "ca", None) is None:
        return local
    if not (args.cache_dir / OIDC_TOKEN).exists():
        return local or None
    return cached_token(args.cache_dir, _bound(args)) or local or None


def _bound(args: argparse.Namespace) -> Bound:
    """The routers this command reaches and the CA that verifies them (what a cached token must be bound to)."""
    if getattr(args, "plaintext", False):
        return Bound.of(router_addresses(args), None)
    ca = getattr(args, "ca", None) or args.cache_dir / LOCAL_PKI / CA_CERT
    try:
        pem = ca.read_bytes()
    except OSError as exc:
        raise PKIError(f"{ca}: {exc.strerror or exc} (pass --ca with the cluster's CA bundle)") from None
    return Bound.of(router_addresses(args), pem)


def dialer(args: argparse.Namespace, token: str | None) -> Dialer:
    """Channels as the flags say (:func:`add_connect_flags`), sending
    ``token`` unless a certificate is presented. PKIError (a ValueError)
    naming the file when the CA or certificate cannot be used."""
    if args.plaintext:
        if args.cert or args.ca:
            raise PKIError("--plaintext presents no certificate and verifies none: drop --cert/--ca, or --plaintext")
        return Dialer(None, token)
    ca = args.ca or args.cache_dir / LOCAL_PKI / CA_CERT
    hint = "" if args.ca else " (pass --ca with the cluster's CA bundle; `kvrelay serve` makes the local one)"
    try:
        ca_pem = read_pem(ca, "CA bundle")
    except PKIError as exc:
        raise PKIError(f"{exc}{hint}") from None
    try:
        revoked = parse_serials([s for s in args.revoked.split(",") if s.strip()])
    except ValueError:
        raise PKIError(f"--revoked takes comma-separated hex serials, got {args.revoked!r}") from None
    if args.cert is None:
        return Dialer(TLSMaterial(ca_pem, revoked=RevokedSerials(revoked)), token)
    if args.key is None:
        raise PKIError("--cert needs --key")
    cert, key = read_pem(args.cert, "certificate"), read_pem(args.key, "key")
    info = check_pair(cert, key, ca_pem, str(args.cert))
    return Dialer(TLSMaterial(ca_pem, cert, key, info.identity, RevokedSerials(revoked)))


def operator_token(token_file: Path) -> str | None:
    """The operator token: $KVRELAY_OPERATOR_TOKEN, else ``token_file`` (kvrelay serve writes it)."""
    token = os.environ.get("KVRELAY_OPERATOR_TOKEN", "")
    if not token and token_file.exists():
        token = token_file.read_text().strip()
    return token or None


def client_dialer(args: argparse.Namespace) -> Dialer:
    """Channels as a tenant: its token, or its certificate."""
    return dialer(args, client_token(args))


TLS_HINTS = (("certificate verify failed", "the router's certificate is not from the CA given (--ca)"),
             ("certificate signature failure", "the router's certificate is not from the CA given (--ca)"),
             ("unable to get local issuer", "the router's certificate is not from the CA given (--ca)"),
             ("Hostname Verification", "the router's certificate is not valid for this address "
                                       "(tls.server_names adds names)"),
             ("WRONG_VERSION_NUMBER", "the router does not speak TLS (tls.enabled: false? then --plaintext)"),
             ("Socket closed", "the router closed the connection during the TLS handshake: it speaks TLS and "
                               "refused this client (plaintext client, or a certificate it does not accept: "
                               "expired, revoked or from another CA; with --cert use its internal port)"))


def grpc_error(exc) -> int:
    """Prints a failed call's status (with what a TLS failure means); returns 1."""
    details = exc.details() or ""
    connecting = "failed to connect" in details  # the channel never got through its handshake
    hint = next((h for pattern, h in TLS_HINTS if connecting and pattern in details), "")
    print(f"kvrelay: error: {exc.code().name}: {details}" + (f"\nkvrelay: {hint}" if hint else ""), file=sys.stderr)
    return 1


def table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())


def default_token_file() -> Path:
    """Where `kvrelay serve` writes its per-run operator token: beside the model cache."""
    return default_cache_dir() / "operator-token"


def write_secret(path: Path, value: str) -> None:
    """Writes ``value`` (one line) to ``path``, readable by this user only."""
    write_private(path, (value + "\n").encode())


def router_addresses(args: argparse.Namespace) -> list[str]:
    """``--router``'s addresses, in the order given."""
    return [a.strip() for a in (getattr(args, "router", None) or "").split(",") if a.strip()]


class NoRouter(RuntimeError):
    """None of the routers given may read this tenant's prompts, or none answered; the message says which."""


def routers_for(args: argparse.Namespace, dialer: Dialer, timeout_s: float = 5.0) -> list[str]:
    """The routers to try, in order: with one address, it; with several, those of them that read this
    tenant's prompts (each asked who it is with ListRouters; one that does not answer is left out).
    NoRouter when none may, naming the routers that would (from the routers' own list)."""
    given = router_addresses(args)
    if len(given) <= 1:
        return given
    ours, listed, silent = [], None, []
    for address in given:
        try:
            with dialer.sync(address) as ch:
                resp = igrpc.InferenceStub(ch).ListRouters(ipb.ListRoutersRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            silent.append(f"{address} ({exc.code().name})")
            continue
        listed = resp
        if resp.answered_by in resp.yours or not resp.answered_by:
            ours.append(address)
    if ours:
        return ours
    if listed is None:
        raise NoRouter(f"no router answered: {', '.join(silent)}")
    yours = [f"{r.name} ({r.site}, {r.jurisdiction}) at {r.address}" for r in listed.routers
             if r.name in listed.yours]
    raise NoRouter("none of the routers given reads this tenant's prompts (its jurisdictions); "
                   + (f"use {'; '.join(yours)}" if yours else "no live router does"))
