"""A probe of a process's /livez or /readyz (runtime/health.py), as a kubelet makes it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def probe(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, dict]:
    """(HTTP status, JSON body) of ``GET path`` on 127.0.0.1:``port``; (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)
    except OSError as exc:
        return 0, {"reason": str(exc)}
