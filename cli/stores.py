"""`kvrelay stores`: what an etcd or PostgreSQL kvrelay does not start (the Helm chart's
``etcd.endpoints``, ``postgres.endpoints``) needs from the cluster: ``etcd-users`` prints the
etcdctl lines that admit only the config's routers (launch/etcd_auth.py), ``crl`` writes the
CA's revocation list of ``tls.revoked_serials`` for both servers. `kvrelay serve` does both
for the stores it starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrelay.cli.pki import _error, issuing_ca
from kvrelay.launch.etcd_auth import router_commands
from kvrelay.runtime.config import load_config
from kvrelay.runtime.pki import Identity, PKIError, crl_pem, write_private
from kvrelay.runtime.tls import parse_serials


def cmd_stores_crl(args: argparse.Namespace) -> int:
    """Writes the CA's revocation list of the config's ``tls.revoked_serials`` (PEM) to ``args.out``."""
    try:
        ca = issuing_ca(args, "kvrelay stores crl")
        serials = parse_serials(load_config(args.config).tls.revoked_serials)
        write_private(args.out, crl_pem(ca, serials, args.days))
    except PKIError as exc:
        return _error(str(exc))
    print(f"kvrelay: {args.out}: {len(serials)} revoked serial(s), valid {args.days:g} days; give it to your etcd "
          "(--client-crl-file, --peer-crl-file: read at each handshake) and PostgreSQL (ssl_crl_file, then "
          "pg_ctl reload), and make it again before then and whenever tls.revoked_serials changes")
    return 0


def cmd_stores_etcd_users(args: argparse.Namespace) -> int:
    """Prints the etcdctl commands that let only the config's routers use an etcd kvrelay does not start."""
    cfg = load_config(args.config)
    routers = [i for r in cfg.routers if (i := Identity.parse(r.uri)) is not None]
    if len(routers) < 2:
        return _error(f"{args.config}: routers: lists {len(routers)} router(s); etcd serves two or more")
    print(f"# etcd's users and roles for {len(routers)} routers under {cfg.etcd.prefix} (launch/etcd_auth.py): "
          "run once, with etcdctl's --endpoints, --cacert, --cert and --key of an administrator")
    print("\n".join(router_commands(cfg.etcd.prefix, routers)))
    return 0


def add_parsers(sub) -> None:
    """``kvrelay stores crl | etcd-users``."""
    stores = sub.add_parser("stores", help="what your own etcd and PostgreSQL need for the routers (their users "
                                           "and roles, the revocation list)").add_subparsers(
        dest="stores_command", required=True)
    crl = stores.add_parser("crl", help="the CA's revocation list of the config's tls.revoked_serials")
    crl.add_argument("--config", required=True, type=Path, help="the cluster config (its tls.revoked_serials)")
    crl.add_argument("--out", required=True, type=Path, help="where to write the list (PEM)")
    crl.add_argument("--ca-dir", type=Path, help="the CA folder made by kvrelay pki init")
    crl.add_argument("--ca", type=Path, help="CA certificate (instead of --ca-dir)")
    crl.add_argument("--ca-key", type=Path, help="CA key (instead of --ca-dir)")
    crl.add_argument("--days", type=float, default=7.0, help="how long the list is valid (servers refuse every "
                                                             "client once it expires; default: %(default)g)")
    crl.set_defaults(func=cmd_stores_crl)
    eu = stores.add_parser("etcd-users", help="the etcdctl commands that admit only the config's routers to your "
                                              "etcd (each router's certificate CN a user of the routers' role)")
    eu.add_argument("--config", required=True, type=Path, help="the cluster config (its routers: and etcd.prefix)")
    eu.set_defaults(func=cmd_stores_etcd_users)
