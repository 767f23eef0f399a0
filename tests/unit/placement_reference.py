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
from dataclasses import dataclass, field

from kvrelay.engine.blocks import blocks_for
from kvrelay.runtime.config import PlacementPolicy
from kvrelay.runtime.roles import Role

POLICIES = tuple(PlacementPolicy)
"""Every policy's name."""
DISAGG_OVERHEAD_S = 0.002
"""Extra RPCs of a disaggregated request (reservation, prefill call), measured
on loopback at ~1-3 ms; charged to every disaggregated candidate."""


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
class WorkerView:
    """What placement knows about one worker (from registration and heartbeats)."""

    worker_id: str
    role: Role
    site: str
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    """Requests the router has on this worker now."""
    max_inflight: int = 64
    queued_prefill_tokens: int = 0
    running: int = 0
    waiting: int = 0
    free_blocks: int = 1 << 30
    prefill_tokens_per_s: float = 0.0
    """Measured; 0 = not yet (the view's default applies)."""
    decode_step_s: float = 0.0
    tenants: frozenset[str] = frozenset()
    """Its pool is dedicated to these tenants; empty: shared by every tenant."""

    def serves(self, tenant: str) -> bool:
        """Its pool takes ``tenant``'s requests."""
        return not self.tenants or tenant in self.tenants

    @property
    def load(self) -> int:
        return self.inflight + self.waiting


@dataclass(slots=True)
class LinkView:
    rtt_ms: float
    gbps: float
    up: bool = True
    name: str = ""
    """e.g. "toronto-montreal"; "" within a site."""


@dataclass(slots=True)
class ClusterView:
    """A snapshot of the cluster for one decision."""

    workers: list[WorkerView]
    jurisdiction: dict[str, str]
    """Site -> jurisdiction."""
    links: dict[frozenset, LinkView] = field(default_factory=dict)
    """Between two sites, keyed by frozenset({a, b})."""
    local_link: LinkView = field(default_factory=lambda: LinkView(0.2, 10.0))
    block_size: int = 16
    kv_block_bytes: int = 0
    """Bytes of one block's KV over all layers (K and V)."""
    num_layers: int = 1
    default_prefill_tokens_per_s: float = 1000.0
    colocate_below_tokens: int = 32
    herd_tolerance: float = 0.05
    max_prefill_queue_s: float = float("inf")
    """A prefill worker with more queued work than this takes no new prompt: the
    decode worker's reservation would outlive its lease while the prompt waits."""

    def link(self, a: str, b: str) -> LinkView | None:
        """The usable link between sites ``a`` and ``b`` (None: none, or down)."""
        link = self.local_link if a == b else self.links.get(frozenset((a, b)))
        return link if link is not None and link.up else None

    def throughput(self, w: WorkerView) -> float:
        return w.prefill_tokens_per_s or self.default_prefill_tokens_per_s


@dataclass(slots=True)
class PlacementRequest:
    prompt_tokens: int
    cached_blocks: dict[str, int] = field(default_factory=dict)
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
    """Prefill and decode workers the request may use, or PlacementError."""
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


def _linked(prefills: list[WorkerView], d: WorkerView, view: ClusterView) -> list[WorkerView]:
    return [p for p in prefills if view.link(p.site, d.site) is not None]


# ---------------------------------------------------------------- policies
class Policy:
    """Chooses among eligible workers. Stateless apart from a turn counter
    and a random generator (seedable for tests)."""

    name = ""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self._turn = itertools.count()
        self._prefill_turn = itertools.count()  # (the one change since: ties rotate per role)

    def place(self, req: PlacementRequest, view: ClusterView) -> Placement:
        prefills, decodes = _eligible(req, view)
        placement = self.choose(req, view, prefills, decodes)
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

    def choose(self, req: PlacementRequest, view: ClusterView, prefills: list[WorkerView],
               decodes: list[WorkerView]) -> Placement:
        raise NotImplementedError

    def _short(self, req: PlacementRequest, view: ClusterView) -> bool:
        return req.prompt_tokens < view.colocate_below_tokens


class RoundRobin(Policy):
    name = "round_robin"

    def choose(self, req, view, prefills, decodes):
        turn = next(self._turn)
        d = sorted(decodes, key=lambda w: w.worker_id)[turn % len(decodes)]
        linked = sorted(_linked(prefills, d, view), key=lambda w: w.worker_id)
        if not linked or self._short(req, view):
            return Placement(d, None)
        return Placement(d, linked[turn % len(linked)])


class LeastLoaded(Policy):
    name = "least_loaded"

    def _least(self, workers: list[WorkerView], turns=None) -> WorkerView:
        best = min(w.load for w in workers)
        tied = [w for w in workers if w.load == best]
        return tied[next(turns or self._turn) % len(tied)]

    def choose(self, req, view, prefills, decodes):
        d = self._least(decodes)
        linked = _linked(prefills, d, view)
        if not linked or self._short(req, view):
            return Placement(d, None)
        return Placement(d, self._least(linked, self._prefill_turn))


class PrefixAware(LeastLoaded):
    name = "prefix_aware"

    def _best(self, workers: list[WorkerView], cached: dict[str, int], turns=None) -> WorkerView:
        top = max(cached.get(w.worker_id, 0) for w in workers)
        return self._least([w for w in workers if cached.get(w.worker_id, 0) == top], turns)

    def choose(self, req, view, prefills, decodes):
        d = self._best(decodes, req.cached_blocks)
        linked = _linked(prefills, d, view)
        whole = req.cached_blocks.get(d.worker_id, 0) >= req.prompt_tokens // view.block_size
        if not linked or whole or self._short(req, view):
            return Placement(d, None)
        return Placement(d, self._best(linked, req.cached_blocks, self._prefill_turn))


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
    name = "cost_model"

    def choose(self, req, view, prefills, decodes):
        # cost(P, D) = A(P) + exposed(site(P) -> D) + admission(D). The best P of
        # a site is the same for every D, and exposed() depends on D only through
        # its site and cached blocks: the best disaggregated cost is computed once
        # per (D's site, D's cached blocks), then each D costs O(1).
        cached = req.cached_blocks
        by_site: dict[str, list[tuple[float, WorkerView]]] = {}
        for p in prefills:
            by_site.setdefault(p.site, []).append((_compute_s(req, view, p), p))
        best_of_site = {s: min(c for c, _ in ps) for s, ps in by_site.items()}
        disagg: dict[tuple[str, int], tuple[float, str | None]] = {}

        def best_disaggregated(d_site: str, d_cached: int) -> tuple[float, str | None]:
            best = (float("inf"), None)
            for site, a in best_of_site.items():
                link = view.link(site, d_site)
                if link is not None:
                    cost = a + _exposed_s(req, view, link, a, d_cached) + DISAGG_OVERHEAD_S
                    if cost < best[0]:
                        best = (cost, site)
            disagg[(d_site, d_cached)] = best
            return best

        disaggregate = bool(best_of_site) and not self._short(req, view)
        cands: list[tuple[float, WorkerView, str | None]] = []
        best = float("inf")
        for d in decodes:
            d_cached = cached.get(d.worker_id, 0)
            admit = _admission_s(d)
            cost = _colocated_s(req, view, d)
            cands.append((cost, d, None))
            best = min(best, cost)
            if disaggregate:
                cost, site = disagg.get((d.site, d_cached)) or best_disaggregated(d.site, d_cached)
                if site is not None:
                    cands.append((cost + admit, d, site))
                    best = min(best, cost + admit)
        near = _most_cached([c for c in cands if c[0] <= best * (1 + view.herd_tolerance) + 1e-4],
                            lambda c: cached.get(c[1].worker_id, 0))
        _, d, site = near[self.rng.randrange(len(near))]
        if site is None:
            return Placement(d, None)
        a_best = best_of_site[site]
        ps = _most_cached([p for c, p in by_site[site] if c <= a_best * (1 + view.herd_tolerance) + 1e-4],
                          lambda p: cached.get(p.worker_id, 0))
        return Placement(d, ps[self.rng.randrange(len(ps))])


def _most_cached(items: list, cached_of) -> list:
    """Among near-equal candidates, those holding the most of the prompt
    (less to move, and blocks reused rather than newly filled)."""
    top = max(cached_of(x) for x in items)
    return [x for x in items if cached_of(x) == top]


def make_policy(name: str, seed: int | None = None) -> Policy:
    """The policy called ``name`` (one of POLICIES)."""
    classes = {c.name: c for c in (RoundRobin, LeastLoaded, PrefixAware, CostModel)}
    if name not in classes:
        raise ValueError(f"unknown placement policy {name!r}; expected one of {', '.join(POLICIES)}")
    return classes[name](seed)


def place(req: PlacementRequest, view: ClusterView, policy: Policy) -> Placement:
    """Chooses workers for ``req`` under ``policy``; raises PlacementError."""
    return policy.place(req, view)
