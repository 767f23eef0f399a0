"""Placement's hard constraints, each written once, as masks over the view's rows
(router/placement/views.py), applied in stages. The rows left are what a policy may
choose from; when no decode row is left, the stage that emptied the set names why:

1. available: healthy, not draining, not excluded (failed this request before),
   in a pool open to the tenant. Nothing left: UNAVAILABLE (workers may come back).
2. jurisdiction: at a site whose jurisdiction the request allows. Nothing left:
   CONSTRAINT (the request is not served elsewhere).
3. room: below ``max_inflight`` less the batch reserve, and, for a decode worker,
   free KV blocks for the prompt it does not hold; for a prefill worker, its queue
   within ``max_prefill_queue_s``. Nothing left: CAPACITY (running requests free it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvrelay.engine.blocks import blocks_for
from kvrelay.router.placement.errors import PlacementError, PlacementFailure, Wait
from kvrelay.router.placement.estimate import throughputs
from kvrelay.router.placement.views import ClusterView
from kvrelay.runtime.roles import Role

if TYPE_CHECKING:
    from kvrelay.router.placement.place import PlacementRequest

_EMPTY = np.zeros(0, np.int64)


@dataclass(slots=True)
class Eligible:
    """Rows (in view order) the request may use, and the prompt's leading
    blocks each row holds (from the prefix index)."""

    prefill: np.ndarray
    decode: np.ndarray
    cached: np.ndarray


def available(req: PlacementRequest, view: ClusterView) -> np.ndarray:
    """Stage 1: healthy, not draining, not excluded, in a pool open to the request's tenant."""
    t, c = view.table, view.table.cols
    ok = c.healthy & ~c.draining
    for wid in req.exclude:
        r = t.row.get(wid)
        if r is not None:
            ok[r] = False
    if t.dedicated.any():
        ok &= t.serves(req.tenant)
    return ok


def in_jurisdiction(req: PlacementRequest, view: ClusterView) -> np.ndarray:
    """Stage 2: at a site whose jurisdiction the request allows (every row when it names none)."""
    t = view.table
    if req.allowed_jurisdictions is None or not len(t.sites):
        return np.ones(len(t.workers), np.bool_)
    site_ok = np.array([view.jurisdiction.get(s) in req.allowed_jurisdictions for s in t.sites], np.bool_)
    return site_ok[t.site]


def slot_free(req: PlacementRequest, view: ClusterView) -> np.ndarray:
    """Stage 3, every row: a slot below ``max_inflight`` less the batch reserve."""
    c = view.table.cols
    return c.inflight + req.reserve < c.max_inflight


def blocks_free(req: PlacementRequest, view: ClusterView, cached: np.ndarray) -> np.ndarray:
    """Stage 3, decode rows: free KV blocks for the prompt (and its first token) less what the row
    holds, each row in its own block size (``cached`` counts the view's blocks)."""
    t = view.table
    if not t.own_block_sizes:
        return t.cols.free_blocks >= blocks_for(req.prompt_tokens + 1, view.block_size) - cached
    bs = np.where(t.block_size > 0, t.block_size, view.block_size)
    need = -(-(req.prompt_tokens + 1) // bs) - cached * view.block_size // bs
    return t.cols.free_blocks >= need


def queue_short(view: ClusterView) -> np.ndarray:
    """Stage 3, prefill rows: queued prompt tokens within ``max_prefill_queue_s`` at the row's throughput."""
    return view.table.cols.queued_prefill_tokens / throughputs(view) <= view.max_prefill_queue_s


def eligible(req: PlacementRequest, view: ClusterView) -> Eligible:
    """The rows that pass every stage; PlacementError naming the stage that left no decode row."""
    t = view.table
    cached = t.cached(req.cached_blocks)
    ok = available(req, view)
    if not (t.decode & ok).any():
        raise unavailable(req, view)
    ok &= in_jurisdiction(req, view)
    if not (t.decode & ok).any():
        raise outside_jurisdictions(req, view)
    ok &= slot_free(req, view)
    decode = np.flatnonzero(t.decode & ok & blocks_free(req, view, cached))
    if not len(decode):
        raise PlacementError(PlacementFailure.CAPACITY, "every eligible decode worker is full", retry_after_s=1.0,
                             wait=Wait.ROOM)
    if req.colocated_only:
        return Eligible(_EMPTY, decode, cached)
    return Eligible(np.flatnonzero(t.prefill & ok & queue_short(view)), decode, cached)


def unavailable(req: PlacementRequest, view: ClusterView) -> PlacementError:
    """Stage 1 left no decode worker: none is up in a pool open to the tenant (it may come back)."""
    dedicated = f" in a pool open to tenant {req.tenant!r} (the others are dedicated to other tenants)"
    return PlacementError(PlacementFailure.UNAVAILABLE, "no healthy decode worker is registered"
                          + (dedicated if view.table.dedicated.any() else ""), wait=Wait.WORKERS)


def outside_jurisdictions(req: PlacementRequest, view: ClusterView) -> PlacementError:
    """Stage 2 left no decode worker: naming the allowed jurisdictions' sites, and those of them whose
    decode pool is dedicated to other tenants (those cannot serve it, however long it waits)."""
    allowed = req.allowed_jurisdictions or frozenset()
    closed = {w.site for w in view.workers if w.role == Role.DECODE and not w.serves(req.tenant)}
    sites = sorted(s for s, j in view.jurisdiction.items() if j in allowed and s not in closed)
    dedicated = sorted(s for s, j in view.jurisdiction.items() if j in allowed and s in closed)
    return PlacementError(PlacementFailure.CONSTRAINT,
                          f"no healthy decode worker in the allowed jurisdictions {sorted(allowed)} "
                          f"(sites there: {sites or 'none'}"
                          + (f"; dedicated to other tenants: {dedicated}" if dedicated else "")
                          + "); the request is not served elsewhere",
                          wait=Wait.WORKERS if sites else Wait.NOTHING)
