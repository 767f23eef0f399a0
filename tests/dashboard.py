"""The Grafana dashboard of observability/ as the tests read it: its panels
and their PromQL, with Grafana's variables replaced so Prometheus can run it
(the unit tests check the names, the integration tests run it on real data)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "observability" / "grafana" / "kvrelay.json"


def load_dashboard() -> dict:
    """The dashboard's JSON."""
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> Iterator[dict]:
    """Every panel, rows' nested panels included."""
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))


def exprs(dash: dict) -> list[str]:
    """Every PromQL expression of every panel's targets."""
    return [t["expr"] for p in all_panels(dash["panels"]) for t in p.get("targets", []) if t.get("expr")]


def substitute(expr: str) -> str:
    """``expr`` with Grafana's variables replaced: intervals by 1m, template variables by ``.*``."""
    expr = re.sub(r"\$\{?__\w+\}?", "1m", expr)
    return re.sub(r"\$\{\w+(:\w+)?\}|\$\w+", ".*", expr)
