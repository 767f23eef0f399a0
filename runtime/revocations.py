"""A process's revoked serials followed from its config file while it runs: when
the file changes (an operator's edit, a Kubernetes ConfigMap update), its
``tls.revoked_serials`` replace the process's set (:class:`RevokedSerials`,
shared by every holder of its TLS material), so each certificate check after it
refuses the new serials without a restart. Calls already admitted go on; a
config that does not load is logged and changes nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from kvrelay.runtime.config import ConfigError, load_config
from kvrelay.runtime.files import file_stamp, polls
from kvrelay.runtime.tls import RevokedSerials, parse_serials

log = logging.getLogger(__name__)

POLL_S = 2.0
"""How often the config file is looked at (its size, time and inode)."""

Changed = Callable[[frozenset[int], frozenset[int]], None]
"""Told the serials (added, removed) after each change."""


def reload_revocations(path: Path, revoked: RevokedSerials) -> tuple[frozenset[int], frozenset[int]] | None:
    """``tls.revoked_serials`` of the config at ``path`` into ``revoked``: the serials (added,
    removed); None (logged) when the config does not load."""
    try:
        serials = parse_serials(load_config(path).tls.revoked_serials)
    except (ConfigError, OSError, ValueError) as exc:
        log.error("%s changed but does not load (%s): the revoked serials stay as they were", path, exc)
        return None
    return revoked.replace(serials)


async def follow_revocations(path: str | None, revoked: RevokedSerials | None, stop: asyncio.Event,
                             on_change: Changed | None = None, poll_s: float = POLL_S) -> None:
    """Until ``stop``: every ``poll_s``, a changed config file's revoked serials into ``revoked``."""
    if path is None or revoked is None:
        return
    config = Path(path)
    seen = file_stamp(config)
    async for _ in polls(stop, poll_s):
        now = file_stamp(config)
        if now is None or now == seen:
            continue
        seen = now
        changed = reload_revocations(config, revoked)
        if changed is not None and (changed[0] or changed[1]):
            log.warning("tls.revoked_serials changed in %s: %d refused now (added %s; removed %s)", config,
                        len(revoked), _hex(changed[0]) or "none", _hex(changed[1]) or "none")
            if on_change is not None:
                on_change(*changed)


def _hex(serials: frozenset[int]) -> str:
    return ", ".join(f"{s:x}" for s in sorted(serials))


__all__ = ["POLL_S", "follow_revocations", "reload_revocations"]
