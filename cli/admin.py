"""`kvrelay` operator commands: status, scale, drain, pools, plan, token; and routers (anyone)."""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

import grpc

from kvrelay.cli.common import (
    add_connect_flags,
    client_token,
    default_token_file,
    dialer,
    grpc_error,
    operator_token,
    router_addresses,
    table,
)
from kvrelay.cli.watch import pool_rows, render_status, watch
from kvrelay.runtime.roles import Role
from kvrelay.runtime.rpc import Dialer
from kvrelay.runtime.tokens import token_sha256
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc


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
    """Admin.``method`` at the first --router, as an operator (or with --as-tenant as the tenant)."""
    as_tenant = getattr(args, "as_tenant", False)
    with (dialer(args, client_token(args)) if as_tenant else operator_dialer(args)).sync(
            router_addresses(args)[0]) as ch:
        return getattr(agrpc.AdminStub(ch), method)(request, timeout=30)


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


def fetch_status(ch: grpc.Channel) -> tuple[wpb.ListWorkersResponse, apb.ListPoolsResponse | str]:
    """Registry.ListWorkers (its error raises) and Admin.ListPools (its error: the reason, as text)."""
    workers = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10)
    try:
        pools: apb.ListPoolsResponse | str = agrpc.AdminStub(ch).ListPools(apb.ListPoolsRequest(), timeout=30)
    except grpc.RpcError as exc:
        pools = exc.details() or exc.code().name
    return workers, pools


def status_or_error(ch: grpc.Channel, interval_s: float) -> str:
    """The status as text, or why it could not be read (``--watch`` keeps trying)."""
    try:
        return render_status(*fetch_status(ch))
    except grpc.RpcError as exc:
        return f"kvrelay: error: {exc.code().name}: {exc.details()} (trying again every {interval_s:g} s)\n"


def cmd_status(args: argparse.Namespace) -> int:
    """Prints the status once, or with --watch (or --count) every --interval seconds."""
    if args.interval <= 0 or (args.count is not None and args.count < 1):
        print("kvrelay: --interval must be > 0 and --count >= 1", file=sys.stderr)
        return 2
    with operator_dialer(args).sync(router_addresses(args)[0]) as ch:
        if args.watch or args.count is not None:
            return watch(lambda: status_or_error(ch, args.interval), sys.stdout, args.interval, args.count)
        try:
            text = render_status(*fetch_status(ch))
        except grpc.RpcError as exc:
            return grpc_error(exc)
    sys.stdout.write(text)
    return 0


def tenant_reader_flag(p: argparse.ArgumentParser, what: str) -> None:
    """--as-tenant: read ``what`` with the tenant's own credentials instead of an operator's."""
    p.add_argument("--as-tenant", action="store_true",
                   help=f"read {what} as a tenant, with its own credentials ($KVRELAY_API_KEY or the local client "
                        "token, or --cert a client certificate): that tenant's only")


def operator_flags(p: argparse.ArgumentParser) -> None:
    """The router's address, CA and operator credentials (token file or --cert)."""
    add_connect_flags(p)
    p.add_argument("--token-file", type=Path, default=default_token_file(),
                   help="operator token (default: %(default)s, written by kvrelay serve; "
                        "$KVRELAY_OPERATOR_TOKEN takes precedence)")


def cmd_routers(args: argparse.Namespace) -> int:
    """The deployment's live routers, from the first of --router that answers; with this tenant's
    token, which of them read its prompts (the others refuse them unread)."""
    resp, error = None, None
    client = dialer(args, client_token(args))
    for address in router_addresses(args):
        try:
            with client.sync(address) as ch:
                resp = igrpc.InferenceStub(ch).ListRouters(ipb.ListRoutersRequest(), timeout=10)
            break
        except grpc.RpcError as exc:
            error = exc
    if resp is None:
        return grpc_error(error) if error is not None else 2
    table([("ROUTER", "SITE", "JURISDICTION", "GRPC", "HTTP", "READS YOUR PROMPTS")] + [
        (r.name or "-", r.site or "-", r.jurisdiction or "-", r.address, r.http_address or "-",
         ("yes" if r.name in resp.yours else "no") if resp.yours else "?")
        for r in resp.routers])
    print(f"(as router {resp.answered_by or 'of a one-router deployment'} lists them"
          + ("" if resp.yours else "; no tenant credential: whose prompts each reads is not shown") + ")")
    return 0


def add_parsers(sub) -> None:
    ro = sub.add_parser("routers", help="the deployment's routers, their sites, and which read your prompts")
    add_connect_flags(ro)
    ro.set_defaults(func=cmd_routers)

    st = sub.add_parser("status", help="sites, pools, workers with load and KV usage, links, recent latency")
    st.add_argument("--watch", action="store_true", help="redraw it every --interval seconds until Ctrl-C")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between frames (default: %(default)s)")
    st.add_argument("--count", type=int, help="with --watch: stop after this many frames (implies --watch)")
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
