"""`kvrelay governance`: the data-handling statement of the running deployment
(router/governance/statement.py, through the Admin API), as JSON or as a Markdown
document rendered from that JSON: one section per tenant, the eight
questions as headings, each answer and the facts it was made from."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from kvrelay.cli.admin import admin_call, operator_flags, tenant_reader_flag
from kvrelay.cli.common import grpc_error
from kvrelay.v1 import admin_pb2 as apb


def _value(v) -> str:
    """A fact's value on one line: text as is, anything else as compact JSON."""
    return v if isinstance(v, str) else json.dumps(v, separators=(", ", ": "))


def _facts(facts: dict) -> list[str]:
    return [f"- `{k}`: {_value(v)}" for k, v in facts.items()]


def _deployment(dep: dict) -> list[str]:
    router = dep.get("router", {})
    where = f"{router.get('site')} ({router.get('jurisdiction')})" if router.get("site") else "undeclared site"
    lines = ["## Deployment", "", f"- kvrelay {dep.get('kvrelay_version')}; router at {where}, host "
                                  f"{router.get('host')}"]
    for site in dep.get("sites", []):
        pools = ", ".join(f"{p['role']} {p['desired']} ({p['sharing']}"
                          + (f": {', '.join(p['dedicated_to'])}" if p["dedicated_to"] else "") + ")"
                          for p in site.get("pools", []))
        lines.append(f"- site {site['site']} ({site['jurisdiction']}): {pools}")
    return lines + [""]


def render_markdown(doc: dict) -> str:
    """The statement ``doc`` (``statement_json`` parsed) as a Markdown document."""
    lines = ["# Data-handling statement", "",
             f"Generated {doc.get('generated_at')} from the running deployment's configuration and state.", ""]
    lines += _deployment(doc.get("deployment", {}))
    for tenant in doc.get("tenants", []):
        lines += [f"## Tenant `{tenant['tenant']}`", ""]
        lines += [f"> **WARNING:** {w}" for w in tenant.get("warnings", [])]
        lines += [""] if tenant.get("warnings") else []
        for a in tenant["answers"]:
            lines += [f"### {a['question']}. {a['title']}", "", a["answer"], "", "Facts:", ""]
            lines += _facts(a.get("facts", {})) + [""]
    return "\n".join(lines).rstrip() + "\n"


def cmd_governance(args: argparse.Namespace) -> int:
    """Prints the statement of ``--tenant`` (default: every tenant)."""
    try:
        resp = admin_call(args, "Governance", apb.GovernanceRequest(tenant=args.tenant or ""))
    except grpc.RpcError as exc:
        return grpc_error(exc)
    doc = json.loads(resp.statement_json)
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.format == "json" else render_markdown(doc))
    return 0


def add_parsers(sub) -> None:
    g = sub.add_parser("governance", help="the data-handling statement of the running deployment, per tenant "
                                          "(operators)")
    g.add_argument("--tenant", help="one tenant (default: every tenant)")
    g.add_argument("--format", choices=["md", "json"], default="md", help="Markdown (default) or JSON")
    operator_flags(g)
    tenant_reader_flag(g, "its statement")
    g.set_defaults(func=cmd_governance)
