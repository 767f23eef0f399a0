"""Placement: which prefill worker and which decode worker serve a request.

``place(request, view, policy)`` is a pure function of a snapshot of the
cluster (no I/O, no clock), so the live router, the tests and a capacity
simulator run the same code. Hard constraints come first (jurisdiction,
dedicated pools, health, draining, a usable link, room at the decode worker); then the
named policy chooses among what is left:

- ``round_robin``: decode and prefill workers in turn;
- ``least_loaded``: fewest requests in flight and queued;
- ``prefix_aware``: most leading prompt blocks already cached, then least loaded;
- ``cost_model`` (default): the lowest estimated time to first token over
  every (prefill, decode) pair and every colocated decode worker, with a
  little randomness among near-ties against herding.

The cost model, per candidate (seconds)::

    disaggregated = queue(P) + compute(P) + exposed transfer + admission(D) + overhead
      queue(P)    = queued prompt tokens at P / P's measured prefill throughput
      compute(P)  = prompt tokens not in P's prefix cache / throughput
      transfer    = KV bytes of the blocks D does not hold / link bandwidth
      exposed     = max(transfer / layers, transfer - compute(P)) + link RTT
                    (layer-wise streaming hides what overlaps the prefill)
    colocated     = compute(D) x (1 + sequences running at D) + queue(D) + admission(D)
    admission(D)  = sequences waiting at D x D's mean decode step

A colocated prefill stalls every sequence running at D for its compute
time; that delay is charged as if it were the new request's, so an idle
decode worker prefills short or cached prompts itself, and a busy one
hands them to the prefill pool unless the link costs more.

Pairs only span sites joined by a link that is up; workers of one site use
the site's local link.
"""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvrelay.engine.blocks import blocks_for
from kvrelay.router.placement.cost_model import DISAGG_OVERHEAD_S, Eligible, choose_cost_model, eligible_rows
from kvrelay.router.placement.views import ClusterView, LinkView, WorkerView
from kvrelay.runtime.config import PlacementPolicy
from kvrelay.runtime.topology import Role

__all__ = [
    "POLICIES",
    "ClusterView",
    "LinkView",
    "Placement",
    "PlacementError",
    "PlacementFailure",
    "PlacementRequest",
    "Wait",
    "WorkerView",
    "estimate",
    "make_policy",
    "place",
]

POLICIES = tuple(PlacementPolicy)
"""Every policy's name."""
class PlacementFailure(enum.StrEnum):
    """Why no placement is possible."""

    CONSTRAINT = "constraint"
    """The request's constraints exclude every worker (it is not served elsewhere)."""
    CAPACITY = "capacity"
    """Eligible workers exist but are full, or the estimated time to first token
    exceeds the deadline; retry after ``retry_after_s``."""
    UNAVAILABLE = "unavailable"
    """No healthy worker of a needed role."""


class Wait(enum.Enum):
    """What waiting at the router (holding nothing) can bring back."""

    NOTHING = enum.auto()
    """Waiting does not help: answer now."""
    ROOM = enum.auto()
    """Capacity is momentarily used up; running requests free it."""
    WORKERS = enum.auto()
    """Workers that could serve it may come back (restarting, or not yet
    registered with a router that just restarted)."""


class PlacementError(Exception):
    """No placement is possible: ``kind`` says why, ``wait`` whether waiting can help."""

    def __init__(self, kind: PlacementFailure, message: str, retry_after_s: float = 0.0,
                 wait: Wait = Wait.NOTHING) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s
        self.wait = wait

    @property
    def absent(self) -> bool:
        """Workers that could serve it may come back."""
        return self.wait is Wait.WORKERS

    @property
    def full(self) -> bool:
        """Capacity is momentarily used up."""
        return self.wait is Wait.ROOM


@dataclass(slots=True)
class PlacementRequest:
    prompt_tokens: int
    cached_blocks: Mapping[str, int] = field(default_factory=dict)
    """Worker id -> leading blocks of this prompt it holds (the prefix index)."""
    allowed_jurisdictions: frozenset[str] | None = None
    """Hard residency constraint; None = anywhere. Comes from the request or
    the tenant's policy, already merged by the caller."""
    deadline_s: float | None = None
    """Time left for the first token; None = no deadline."""
    exclude: frozenset[str] = frozenset()
    """Workers that already failed this request (never chosen again for it)."""
    colocated_only: bool = False
    """Only the decode worker may compute the prompt (after prefill attempts failed)."""
    tenant: str = ""
    """Whose request: pools dedicated to other tenants are not for it."""
    reserve: int = 0
    """Slots of each worker's ``max_inflight`` it must leave free (batch requests
    leave ``router.interactive_reserve`` for interactive ones)."""


@dataclass(slots=True)
class Placement:
    decode: WorkerView
    prefill: WorkerView | None
    """None = colocated (the decode worker computes the prompt)."""
    policy: str = ""
    """Set by Policy.place, with the estimate below."""
    est_ttft_s: float = 0.0
    cached_blocks_prefill: int = 0
    cached_blocks_decode: int = 0
    link: LinkView | None = None

    @property
    def colocated(self) -> bool:
        return self.prefill is None


# ------------------------------------------------------------ constraints
def _eligible(req: PlacementRequest, view: ClusterView) -> tuple[list[WorkerView], list[WorkerView]]:
    """Prefill and decode workers the request may use, or PlacementError (one
    worker at a time: it names why nothing is eligible; ``eligible_rows`` decides)."""
    allowed = req.allowed_jurisdictions
    prefills, decodes, any_decode, any_allowed_decode = [], [], False, False
    need = blocks_for(req.prompt_tokens + 1, view.block_size)
    for w in view.workers:
        if not w.healthy or w.draining or w.worker_id in req.exclude or not w.serves(req.tenant):
            continue
        if w.role == Role.DECODE:
            any_decode = True
        if allowed is not None and view.jurisdiction.get(w.site) not in allowed:
            continue
        if w.role == Role.PREFILL:
            if not req.colocated_only and w.inflight + req.reserve < w.max_inflight and \
                    w.queued_prefill_tokens / view.throughput(w) <= view.max_prefill_queue_s:
                prefills.append(w)
        elif w.role == Role.DECODE:
            any_allowed_decode = True
            if w.inflight + req.reserve < w.max_inflight and \
                    w.free_blocks >= need - req.cached_blocks.get(w.worker_id, 0):
                decodes.append(w)
    if not decodes:
        if not any_decode:
            raise PlacementError(PlacementFailure.UNAVAILABLE, "no healthy decode worker is registered"
                                 + (f" in a pool open to tenant {req.tenant!r} (the others are dedicated to other "
                                    "tenants)" if any(w.tenants for w in view.workers) else ""),
                                 wait=Wait.WORKERS)
        if not any_allowed_decode:
            # sites whose decode pool is dedicated to other tenants cannot serve it, however long it waits
            closed = {w.site for w in view.workers if w.role == Role.DECODE and not w.serves(req.tenant)}
            sites = sorted(s for s, j in view.jurisdiction.items() if j in (allowed or ()) and s not in closed)
            dedicated = sorted(s for s, j in view.jurisdiction.items() if j in (allowed or ()) and s in closed)
            raise PlacementError(PlacementFailure.CONSTRAINT,
                                 f"no healthy decode worker in the allowed jurisdictions {sorted(allowed or ())} "
                                 f"(sites there: {sites or 'none'}"
                                 + (f"; dedicated to other tenants: {dedicated}" if dedicated else "")
                                 + "); the request is not served elsewhere",
                                 wait=Wait.WORKERS if sites else Wait.NOTHING)
        raise PlacementError(PlacementFailure.CAPACITY, "every eligible decode worker is full", retry_after_s=1.0,
                         wait=Wait.ROOM)
    return prefills, decodes


# ---------------------------------------------------------------- policies
class Policy:
    """Chooses among eligible workers. Stateless apart from a turn counter
    and a random generator (seedable for tests)."""

    name = ""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self._turn = itertools.count()

    def place(self, req: PlacementRequest, view: ClusterView) -> Placement:
        rows = eligible_rows(req, view)
        if not len(rows.decode):
            _eligible(req, view)  # raises the PlacementError that says why
        placement = self.choose_rows(req, view, rows)
        placement.policy = self.name
        placement.cached_blocks_decode = req.cached_blocks.get(placement.decode.worker_id, 0)
        if placement.prefill is not None:
            placement.cached_blocks_prefill = req.cached_blocks.get(placement.prefill.worker_id, 0)
            placement.link = view.link(placement.prefill.site, placement.decode.site)
        placement.est_ttft_s = estimate(req, view, placement.prefill, placement.decode)
        if req.deadline_s is not None and placement.est_ttft_s > req.deadline_s:
            raise PlacementError(PlacementFailure.CAPACITY,
                                 f"estimated time to first token {placement.est_ttft_s:.3f} s exceeds "
                                 f"the request's deadline ({req.deadline_s:.3f} s left)",
                                 retry_after_s=placement.est_ttft_s - req.deadline_s)
        return placement

    def choose_rows(self, req: PlacementRequest, view: ClusterView, rows: Eligible) -> Placement:
        """Chooses among the eligible rows (view order; at least one decode row)."""
        raise NotImplementedError

    def _short(self, req: PlacementRequest, view: ClusterView) -> bool:
        return req.prompt_tokens < view.colocate_below_tokens


def _linked_rows(view: ClusterView, prefill: np.ndarray, d: int) -> np.ndarray:
    """The prefill rows (in view order) with a usable link to decode row ``d``'s site."""
    gbps, _ = view.link_matrix()
    site = view.table.site
    return prefill[~np.isnan(gbps[site[prefill], site[d]])]


def _by_name(view: ClusterView, rows: np.ndarray) -> np.ndarray:
    """``rows`` in worker-id order (a filter of the table's static order: no sort)."""
    keep = np.zeros(len(view.table.by_name), np.bool_)
    keep[rows] = True
    return view.table.by_name[keep[view.table.by_name]]


class RoundRobin(Policy):
    name = "round_robin"

    def choose_rows(self, req, view, rows):
        """Decode and prefill workers in turn, in worker-id order."""
        turn = next(self._turn)
        decodes = _by_name(view, rows.decode)
        d = int(decodes[turn % len(decodes)])
        linked = _linked_rows(view, rows.prefill, d)
        ws = view.table.workers
        if not len(linked) or self._short(req, view):
            return Placement(ws[d], None)
        linked = _by_name(view, linked)
        return Placement(ws[d], ws[int(linked[turn % len(linked)])])


class LeastLoaded(Policy):
    name = "least_loaded"

    def _least(self, view: ClusterView, rows: np.ndarray) -> int:
        """The least loaded row (requests in flight and waiting); ties in turn."""
        c = view.table.cols
        load = c.inflight[rows] + c.waiting[rows]
        tied = rows[load == load.min()]
        return int(tied[next(self._turn) % len(tied)])

    def choose_rows(self, req, view, rows):
        ws = view.table.workers
        d = self._least(view, rows.decode)
        linked = _linked_rows(view, rows.prefill, d)
        if not len(linked) or self._short(req, view):
            return Placement(ws[d], None)
        return Placement(ws[d], ws[self._least(view, linked)])


class PrefixAware(LeastLoaded):
    name = "prefix_aware"

    def _best(self, view: ClusterView, rows: np.ndarray, cached: np.ndarray) -> int:
        """Among the rows holding the most of the prompt, the least loaded."""
        held = cached[rows]
        return self._least(view, rows[held == held.max()])

    def choose_rows(self, req, view, rows):
        ws = view.table.workers
        d = self._best(view, rows.decode, rows.cached)
        linked = _linked_rows(view, rows.prefill, d)
        whole = rows.cached[d] >= req.prompt_tokens // view.block_size
        if not len(linked) or whole or self._short(req, view):
            return Placement(ws[d], None)
        return Placement(ws[d], ws[self._best(view, linked, rows.cached)])


def _compute_s(req: PlacementRequest, view: ClusterView, w: WorkerView) -> float:
    cached = min(req.cached_blocks.get(w.worker_id, 0) * view.block_size, req.prompt_tokens - 1)
    tput = view.throughput(w)
    return (w.queued_prefill_tokens + req.prompt_tokens - cached) / tput


def _exposed_s(req: PlacementRequest, view: ClusterView, link: LinkView, compute_s: float, d_cached: int) -> float:
    blocks = max(0, blocks_for(req.prompt_tokens, view.block_size) - d_cached)
    transfer = blocks * view.kv_block_bytes * 8 / (link.gbps * 1e9)
    return max(transfer / view.num_layers, transfer - compute_s) + link.rtt_ms / 1e3


def _admission_s(d: WorkerView) -> float:
    return d.waiting * d.decode_step_s


def _colocated_s(req: PlacementRequest, view: ClusterView, d: WorkerView, interference: bool = True) -> float:
    """Colocated at D; with ``interference``, plus the stall it imposes on D's running sequences."""
    cached = min(req.cached_blocks.get(d.worker_id, 0) * view.block_size, req.prompt_tokens - 1)
    own = (req.prompt_tokens - cached) / view.throughput(d)
    stall = own * d.running if interference else 0.0
    return own + stall + d.queued_prefill_tokens / view.throughput(d) + _admission_s(d)


def estimate(req: PlacementRequest, view: ClusterView, p: WorkerView | None, d: WorkerView) -> float:
    """Estimated time to first token of one candidate (see the module docstring)."""
    if p is None:
        return _colocated_s(req, view, d, interference=False)
    link = view.link(p.site, d.site)
    if link is None:
        return float("inf")
    compute = _compute_s(req, view, p)
    return (compute + _exposed_s(req, view, link, compute, req.cached_blocks.get(d.worker_id, 0))
            + _admission_s(d) + DISAGG_OVERHEAD_S)


class CostModel(Policy):
    """The lowest estimated TTFT over every pair and colocated candidate,
    scored as numpy vectors over the view's columns (router/placement/cost_model.py)."""

    name = "cost_model"

    def choose_rows(self, req, view, rows):
        d, p = choose_cost_model(req, view, rows, self.rng, not self._short(req, view))
        ws = view.table.workers
        return Placement(ws[d], None if p is None else ws[p])


def make_policy(name: str, seed: int | None = None) -> Policy:
    """The policy called ``name`` (one of POLICIES)."""
    classes = {c.name: c for c in (RoundRobin, LeastLoaded, PrefixAware, CostModel)}
    if name not in classes:
        raise ValueError(f"unknown placement policy {name!r}; expected one of {', '.join(POLICIES)}")
    return classes[name](seed)


def place(req: PlacementRequest, view: ClusterView, policy: Policy) -> Placement:
    """Chooses workers for ``req`` under ``policy``; raises PlacementError."""
    return policy.place(req, view)
