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

import itertools
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvrelay.router.placement.cost_model import choose_cost_model
from kvrelay.router.placement.errors import PlacementError, PlacementFailure, Wait
from kvrelay.router.placement.estimate import admission_s, colocated_s, disaggregated_s, exposed_s, prefill_s
from kvrelay.router.placement.filters import Eligible, eligible
from kvrelay.router.placement.views import ClusterView, LinkView, WorkerView
from kvrelay.runtime.config import PlacementPolicy

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
    leave ``router.admission.interactive_reserve`` for interactive ones)."""
    coded_kv: bool = True
    """Its KV crosses links under their codecs (links[].kv_codec), so a transfer costs their fewer bytes;
    False: its tenant forbids lossy codecs (kv_lossy), every byte crosses."""


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


# ---------------------------------------------------------------- policies
class Policy:
    """Chooses among eligible workers. Stateless apart from turn counters
    (one per role: ties among decode workers rotate however many prefill
    workers each request's choice ties among) and a random generator
    (seedable for tests)."""

    name = ""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self._turn = itertools.count()
        self._prefill_turn = itertools.count()

    def place(self, req: PlacementRequest, view: ClusterView) -> Placement:
        rows = eligible(req, view)  # the hard constraints; PlacementError naming the one that left nothing
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
    """The prefill rows (in view order) with a usable link to decode row ``d``'s site
    and decode row ``d``'s KV layout."""
    gbps, _ = view.link_matrix()
    site = view.table.site
    linked = prefill[~np.isnan(gbps[site[prefill], site[d]])]
    if view.table.num_layouts > 1:
        linked = linked[view.table.layout[linked] == view.table.layout[d]]
    return linked


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

    def _least(self, view: ClusterView, rows: np.ndarray, turns: Iterator[int]) -> int:
        """The least loaded row (requests in flight and waiting); ties in ``turns``."""
        c = view.table.cols
        load = c.inflight[rows] + c.waiting[rows]
        tied = rows[load == load.min()]
        return int(tied[next(turns) % len(tied)])

    def choose_rows(self, req, view, rows):
        ws = view.table.workers
        d = self._least(view, rows.decode, self._turn)
        linked = _linked_rows(view, rows.prefill, d)
        if not len(linked) or self._short(req, view):
            return Placement(ws[d], None)
        return Placement(ws[d], ws[self._least(view, linked, self._prefill_turn)])


class PrefixAware(LeastLoaded):
    name = "prefix_aware"

    def _best(self, view: ClusterView, rows: np.ndarray, cached: np.ndarray, turns: Iterator[int]) -> int:
        """Among the rows holding the most of the prompt, the least loaded."""
        held = cached[rows]
        return self._least(view, rows[held == held.max()], turns)

    def choose_rows(self, req, view, rows):
        ws = view.table.workers
        d = self._best(view, rows.decode, rows.cached, self._turn)
        linked = _linked_rows(view, rows.prefill, d)
        whole = rows.cached[d] >= req.prompt_tokens // view.block_size
        if not len(linked) or whole or self._short(req, view):
            return Placement(ws[d], None)
        return Placement(ws[d], ws[self._best(view, linked, rows.cached, self._prefill_turn)])


def estimate(req: PlacementRequest, view: ClusterView, p: WorkerView | None, d: WorkerView) -> float:
    """Estimated time to first token of one candidate (see the module docstring; the terms
    are router/placement/estimate.py's, which the ``cost_model`` policy scores every candidate with)."""
    bs, prompt = view.block_size, req.prompt_tokens
    d_cached = req.cached_blocks.get(d.worker_id, 0)
    admission = admission_s(d.waiting, d.decode_step_s)
    if p is None:  # what the request itself waits: D's running sequences do not delay it
        own = prefill_s(0, prompt, d_cached, bs, view.throughput(d))
        return float(colocated_s(own, 0, d.queued_prefill_tokens, view.throughput(d), admission))
    link = view.link(p.site, d.site)
    if link is None:
        return float("inf")
    compute = prefill_s(p.queued_prefill_tokens, prompt, req.cached_blocks.get(p.worker_id, 0), bs,
                        view.throughput(p))
    gbps = link.kv_gbps(req.coded_kv)
    return float(disaggregated_s(compute + exposed_s(prompt, d_cached, view, gbps, link.rtt_ms, compute), admission))


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
