"""`kvrelay` operator commands: status, scale, drain, pools, plan, token."""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

import grpc
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

from cli.common import (
    add_connect_flags,
    default_token_file,
    dialer,
    grpc_error,
    operator_token,
    table,
)
from router.auth import token_sha256
from runtime.rpc import Dialer
from runtime.topology import Role


def operator_dialer(args: argparse.Namespace) -> Dialer:
    """Channels as an operator: --cert (an operator certificate), else the
    token ($KVRELAY_OPERATOR_TOKEN, else --token-file)."""
    return dialer(args, operator_token(args.token_file))


def cmd_token(args: argparse.Namespace) -> int:


    token = secrets.token_urlsafe(32)
    who = "tenant" if args.client else "operator"
    print(f"token (give it to the {who}; it is not stored anywhere): {token}")
    if args.client:
        print(f"config lines:\ntenants:\n  - {{name: {args.name}, token_sha256: {token_sha256(token)}}}")
    else:
        print(f"config lines:\nauth:\n  operators:\n    - {{name: {args.name}, token_sha256: {token_sha256(token)}}}")
    return 0


def admin_call(args: argparse.Namespace, method: str, request):


    with operator_dialer(args).sync(args.router) as ch:
        return getattr(agrpc.AdminStub(ch), method)(request, timeout=30)


def pool_rows(pools) -> list[tuple[str, ...]]:
    return [("SITE", "ROLE", "DESIRED", "ACTIVE", "DRAINING", "UNHEALTHY", "WORKERS")] + [
        (p.site, p.role, str(p.desired), str(p.active), str(p.draining), str(p.unhealthy), " ".join(p.workers))
        for p in pools]


def run_admin(args: argparse.Namespace, method: str, request, show) -> int:
    """Calls Admin.``method``; shows the response, or the error with exit code 1."""

    try:
        resp = admin_call(args, method, request)
    except grpc.RpcError as exc:
        return grpc_error(exc)
    show(resp)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:

    if args.replicas < 0:
        print(f"kvrelay: --replicas must be >= 0, got {args.replicas}", file=sys.stderr)
        return 2

    def show(resp) -> None:
        table(pool_rows([resp.pool]))
        if resp.draining:
            print(f"draining (they leave once their requests are done): {', '.join(resp.draining)}")
    return run_admin(args, "Scale", apb.ScaleRequest(site=args.site, role=args.role, replicas=args.replicas), show)


def cmd_drain(args: argparse.Namespace) -> int:

    def show(resp) -> None:
        print(f"kvrelay: draining {args.worker}: no new requests; it leaves once its requests are done")
        table(pool_rows([resp.pool]))
    return run_admin(args, "Drain", apb.DrainRequest(worker_id=args.worker), show)


def cmd_plan(args: argparse.Namespace) -> int:

    def show(resp) -> None:
        table([("SITE", "ROLE", "NOW", "RECOMMENDED", "WHY")] + [
            (p.site, p.role, str(p.current), str(p.recommended), "; ".join(p.reasons)) for p in resp.plans])
        print(f"\n(figures of the last {resp.window_s:g} s; "
              f"{'applied' if resp.applied else 'not applied: add --apply'})")
    return run_admin(args, "Plan", apb.PlanRequest(apply=args.apply), show)


def cmd_pools(args: argparse.Namespace) -> int:

    return run_admin(args, "ListPools", apb.ListPoolsRequest(), lambda resp: table(pool_rows(resp.pools)))


def cmd_status(args: argparse.Namespace) -> int:



    with operator_dialer(args).sync(args.router) as ch:
        try:
            resp = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)
        except grpc.RpcError as exc:
            return grpc_error(exc)
    try:
        table(pool_rows(admin_call(args, "ListPools", apb.ListPoolsRequest()).pools))
    except grpc.RpcError as exc:
        print(f"(pools: {exc.details()})")
    print()
    rows = [("WORKER", "SITE", "ROLE", "HEALTH", "INFLIGHT", "RUNNING", "WAITING", "KV FREE/TOTAL", "CACHED",
             "PREFILL TOK/S", "TRANSPORT", "ADDRESS")]
    for w in resp.workers:
        role = Role.of(w.info.role)
        health = "draining" if w.draining else "ok" if w.healthy else "UNHEALTHY"
        rows.append((w.info.worker_id, w.info.site, role, health, str(w.inflight), str(w.load.running),
                     str(w.load.waiting), f"{w.load.free_blocks}/{w.load.total_blocks}", str(w.cached_blocks),
                     f"{w.load.prefill_tokens_per_s:.0f}", w.info.transport, w.info.address))
    table(rows)
    print(f"\nplacement policy: {resp.policy}\n")
    table([("LINK", "RTT MS", "GBPS", "TRANSPORT", "PROTECTION", "STATE")] + [
        (lk.name, f"{lk.rtt_ms:g}", f"{lk.gbps:g}", lk.transport, lk.protection,
         "up" if lk.up else f"DOWN ({lk.down_reason})") for lk in resp.links])
    return 0


def operator_flags(p: argparse.ArgumentParser) -> None:
    """The router's address, CA and operator credentials (token file or --cert)."""
    add_connect_flags(p)
    p.add_argument("--token-file", type=Path, default=default_token_file(),
                   help="operator token (default: %(default)s, written by kvrelay serve; "
                        "$KVRELAY_OPERATOR_TOKEN takes precedence)")


def add_parsers(sub) -> None:
    st = sub.add_parser("status", help="sites, pools, workers with load and KV usage, links")
    operator_flags(st)
    st.set_defaults(func=cmd_status)

    sc = sub.add_parser("scale", help="set a site's prefill or decode pool size (operators)")
    sc.add_argument("--site", required=True)
    sc.add_argument("--role", required=True, choices=list(Role))
    sc.add_argument("--replicas", required=True, type=int)
    operator_flags(sc)
    sc.set_defaults(func=cmd_scale)

    dr = sub.add_parser("drain", help="stop placing on a worker; it leaves once its requests are done (operators)")
    dr.add_argument("worker", help="worker id, e.g. montreal/decode/1")
    operator_flags(dr)
    dr.set_defaults(func=cmd_drain)

    po = sub.add_parser("pools", help="desired and actual size of every pool (operators)")
    operator_flags(po)
    po.set_defaults(func=cmd_pools)

    pl = sub.add_parser("plan", help="recommended pool sizes from recent load and SLOs (operators)")
    pl.add_argument("--apply", action="store_true", help="set every pool to its recommended size")
    operator_flags(pl)
    pl.set_defaults(func=cmd_plan)

    tk = sub.add_parser("token", help="make an operator (or --client) token and print the config line with its hash")
    tk.add_argument("--name", default="operator", help="who holds it (with --client: the tenant)")
    tk.add_argument("--client", action="store_true", help="a client (tenant) token for tenants")
    tk.set_defaults(func=cmd_token)
