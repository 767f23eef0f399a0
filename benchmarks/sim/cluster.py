"""A simulated kvrelay deployment: the router's admission and its real
``place()`` (router/placement/place.py) and prefix index (router/placement/prefix_index.py)
over the simulated workers' exact state, KV transfers as flows on links,
and failures with the router's recovery.

One request's life, as in DESIGN.md's request path:

1. it arrives; after ``router_s`` (authentication, hashing, the decision)
   the router places it, or queues it while every eligible worker is full
   (for at most ``router.admission.admission_wait_s``), or fails it;
2. disaggregated: the decode worker reserves blocks (one RPC, ``rpc_s``),
   the prefill worker computes the prompt in its batches and streams each
   chunk's KV as its layers finish; the first token travels with the last
   layer (one-way link latency after the last byte);
3. the decode worker decodes in its batches; each token reaches the client
   ``rpc_s`` after its step;
4. a worker dying re-places its requests (a decode worker's migrate with the
   tokens already sent, prefilled again); a failed transfer is placed again
   without that prefill worker; a link down is avoided from then on.

With ``SimConfig.heartbeat_s`` the router's view of the workers lags as a live
one does, and with ``SimConfig.routers`` several routers place at once, each
with its own count of what it sent (issue 36).
"""

from __future__ import annotations

import functools
import random
from collections import deque
from dataclasses import dataclass, field

from kvrelay.benchmarks.metrics import RequestRecord
from kvrelay.benchmarks.sim.clock import Clock
from kvrelay.benchmarks.sim.network import Flow, SimLink
from kvrelay.benchmarks.sim.profile import DTYPE_BYTES, Profile
from kvrelay.benchmarks.sim.worker import HashChain, Hooks, SimSequence, SimWorker, new_sequence
from kvrelay.benchmarks.sim.workload import SimArrival
from kvrelay.engine.blocks import blocks_for
from kvrelay.engine.scheduler import SchedulerOutput
from kvrelay.engine.sequence import Sequence
from kvrelay.kvtransfer.base import KVCodec
from kvrelay.router.placement.link_estimate import LinkMeter, LinkSample
from kvrelay.router.placement.place import (
    ClusterView,
    LinkView,
    PlacementError,
    PlacementRequest,
    WorkerView,
    make_policy,
    place,
)
from kvrelay.router.placement.prefix_index import PrefixIndex
from kvrelay.runtime.config import ClusterConfig, LinkSection
from kvrelay.runtime.roles import Role
from kvrelay.runtime.topology import LOCAL_LINK, link_kv_fraction, link_name

LAYER_PIECES = 8
"""A chunk's KV is handed to the link in this many pieces over its step (layer-wise streaming)."""


class SimInputError(ValueError):
    """The simulation was asked for something the deployment lacks; the message names it."""


@dataclass(slots=True)
class Failure:
    """A worker or a link going down at ``at_s`` (a link comes back after ``for_s``, when given)."""

    kind: str
    """"worker" or "link"."""
    target: str
    """Worker id, or link name "a-b"."""
    at_s: float
    for_s: float | None = None


@dataclass(slots=True)
class SimConfig:
    seed: int = 0
    router_s: float = 0.002
    """Router time per request before its placement: TLS, auth, hashing, the decision."""
    rpc_s: float = 0.0005
    """One internal RPC or streamed message on the local network."""
    failures: list[Failure] = field(default_factory=list)
    rate_changes: list[RateChange] = field(default_factory=list)
    routers: int = 1
    """Routers placing at once, each with its own view: request i enters at router i mod ``routers``
    (one per site: as many as sites). Each counts only its own requests in flight on a worker
    (``max_inflight_per_worker``) and its own prompts sent since a worker's last heartbeat, as live
    routers do; the workers' loads and prefix-cache events reach every router alike, through
    ``heartbeat_s``. Not modelled: the routers' admission queues are one (a waiting request is placed
    by its own router's view, in arrival order with every router's), and quotas are not simulated."""
    heartbeat_s: float = 0.0
    """Workers' heartbeat interval: the lag of every router's view of their load and prefix
    caches (0: exact and at once, the simulator's model before several routers)."""


@dataclass(frozen=True, slots=True)
class RateChange:
    """A link's rate changing at ``at_s`` (the config's figure is its rate until then)."""

    link: str
    """Link name "a-b"."""
    at_s: float
    gbps: float


@dataclass(slots=True, eq=False)
class SimRequest:
    arrival: SimArrival
    chain: HashChain
    record: RequestRecord
    rid: str
    exclude: set[str] = field(default_factory=set)
    colocated_only: bool = False
    p: SimWorker | None = None
    d: SimWorker | None = None
    p_seq: SimSequence | None = None
    d_seq: SimSequence | None = None
    flow: Flow | None = None
    kv_bytes: int = 0
    transfer_s: float = 0.0
    queued_at: float | None = None
    retries: int = 0
    migrations: int = 0
    est_ttft_s: float = 0.0
    link: str = ""
    router: int = 0
    """Which router it entered at (SimConfig.routers)."""
    pending: int = 0
    """Prompt tokens its router sent to ``p`` to compute (less its cached prefix) whose first token has
    not come back (the router's own count)."""
    cached_prefill: int = 0
    """Leading prompt tokens the chosen prefill worker held, as the router's index said."""

    @property
    def sent_tokens(self) -> int:
        return len(self.record.token_times)

    @property
    def decode_worker(self) -> SimWorker:
        """``d``, which every started attempt has."""
        if self.d is None:
            raise RuntimeError(f"request {self.rid} has no attempt started")
        return self.d

    @property
    def decode_sequence(self) -> SimSequence:
        """``d_seq``, which every started attempt has."""
        if self.d_seq is None:
            raise RuntimeError(f"request {self.rid} has no attempt started")
        return self.d_seq

    @property
    def prefill_sequence(self) -> SimSequence:
        """``p_seq``, which an attempt with a prefill worker has from its start."""
        if self.p_seq is None:
            raise RuntimeError(f"request {self.rid} has no prefill sequence")
        return self.p_seq


class SimCluster:
    def __init__(self, cfg: ClusterConfig, profile: Profile, sim: SimConfig) -> None:
        self.cfg, self.profile, self.sim = cfg, profile, sim
        self.clock = Clock()
        self.index = PrefixIndex()
        self.policy = make_policy(cfg.router.placement.policy, sim.seed)
        bs = cfg.cache.block_size
        self.block_size = bs
        self.kv_block_bytes = profile.model.kv_bytes_per_token(profile.dtype) * bs
        self.num_blocks = self._num_blocks()
        self.links: dict[frozenset, SimLink] = {}
        self.local: dict[str, SimLink] = {}
        views = [WorkerView(f"{site.name}/{role.value}/{i}", role, site.name,
                            max_inflight=cfg.router.admission.max_inflight_per_worker, free_blocks=self.num_blocks,
                            tenants=frozenset(pool.tenants))
                 for site in cfg.sites for role, pool in ((Role.PREFILL, site.prefill), (Role.DECODE, site.decode))
                 for i in range(pool.replicas)]
        self.view = self._view(views)
        self.meter = LinkMeter([*(ln.view for ln in self.links.values()), self.view.local_link],
                               cfg.router.placement.link_rates)
        """The router's link estimates, fed by the flows that land (SimLink.on_sample)."""
        self.samples: list[tuple[str, LinkSample, float]] = []
        """(link, a landed flow's sample, the link's rate placement used after it)."""
        hooks = Hooks(self._step_started, self._token, lambda w: self._pump(),
                      lambda w, stored, removed: self.index.apply(w.wid, stored, removed))
        self.local = {site.name: SimLink(self.clock, self.view.local_link, self._sample) for site in cfg.sites}
        self.workers: dict[str, SimWorker] = {
            v.worker_id: SimWorker(v, self.clock, profile, self.num_blocks, bs, cfg.scheduler, hooks) for v in views}
        if sim.routers < 1 or sim.heartbeat_s < 0:
            raise SimInputError(f"routers must be at least 1 (got {sim.routers}) and the heartbeat interval "
                                f"at least 0 (got {sim.heartbeat_s} s)")
        phases = random.Random(sim.seed)
        for w in self.workers.values():
            w.heartbeat_s, w.phase_s = sim.heartbeat_s, phases.uniform(0, sim.heartbeat_s)
        self.own: list[dict[str, int]] = [{} for _ in range(sim.routers)]
        """Per router, its requests in flight per worker (none: absent)."""
        self.pend: list[dict[str, tuple[int, int]]] = [{} for _ in range(sim.routers)]
        """Per router and worker: the prompt tokens it sent there less those that came back prefilled since
        the worker's last heartbeat (as of which heartbeat): what a live router adds to a heartbeat's queue
        at once (registry ``pending_prefill_tokens``)."""
        self._shown = 0
        """The router whose counts the views' ``inflight`` hold now (that of the request being placed)."""
        self._check(sim.failures)
        self._check_rates(sim.rate_changes)
        self.capacity_tokens = min(profile.model.max_context, self.num_blocks * bs)
        """The longest prompt + output a worker takes (the live engine refuses longer ones)."""
        self.active: dict[str, SimRequest] = {}
        self.waiting: deque[SimRequest] = deque()
        self.records: list[RequestRecord] = []

    def _num_blocks(self) -> int:
        tokens = self.profile.kv_capacity_tokens()
        if tokens is not None:
            return max(2, tokens // self.block_size)
        cache = self.cfg.cache
        return cache.num_blocks or max(2, int(cache.memory_gib * 2**30) // self.kv_block_bytes)

    def _view(self, workers: list[WorkerView]) -> ClusterView:
        cfg, r = self.cfg, self.cfg.router
        links = {}
        for ln in cfg.links:
            a, b = ln.between
            lv = LinkView(ln.rtt_ms, ln.gbps, name=link_name(a, b), kv_fraction=self._kv_fraction(ln))
            links[frozenset((a, b))] = lv
            self.links[frozenset((a, b))] = SimLink(self.clock, lv, self._sample)
        local = LinkView(cfg.local_link.rtt_ms, cfg.local_link.gbps, name=LOCAL_LINK,
                         kv_fraction=self._kv_fraction(cfg.local_link))
        return ClusterView(workers, {s.name: s.jurisdiction for s in cfg.sites}, links, local,
                           block_size=self.block_size, kv_block_bytes=self.kv_block_bytes,
                           num_layers=self.profile.model.num_layers,
                           default_prefill_tokens_per_s=r.placement.default_prefill_tokens_per_s,
                           colocate_below_tokens=r.placement.colocate_below_tokens,
                           herd_tolerance=r.placement.herd_tolerance, max_prefill_queue_s=r.liveness.kv_lease_s / 2)

    def _check(self, failures: list[Failure]) -> None:
        """No dedicated pools (not simulated), and every failure names a worker or
        link of this deployment (SimInputError otherwise)."""
        dedicated = [f"{s.name}.{role}" for s in self.cfg.sites for role in Role if s.pool(role).tenants]
        if dedicated:
            raise SimInputError(f"dedicated pools ({', '.join(dedicated)}: tenants) are not simulated: every "
                                "simulated request is one anonymous tenant's; remove their tenants lists")
        links = {ln.name for ln in self.links.values()}
        for f in failures:
            known = self.workers if f.kind == "worker" else links if f.kind == "link" else None
            if known is None:
                raise SimInputError(f"failure kind {f.kind!r}: expected worker or link")
            if f.kind == "worker" and f.for_s is not None:
                raise SimInputError(f"--fail worker:{f.target}: a worker that fails does not come back "
                                    "(+SECONDS is for links)")
            if f.target not in known:
                raise SimInputError(f"--fail {f.kind}:{f.target}: no such {f.kind} in the config (known: "
                                 f"{', '.join(sorted(known)) or 'none'})")

    def _check_rates(self, changes: list[RateChange]) -> None:
        """Every rate change names a link between sites of this deployment and a positive rate."""
        links = {ln.name for ln in self.links.values()}
        for rc in changes:
            if rc.link not in links:
                raise SimInputError(f"--link-rate {rc.link}: no such link in the config (known: "
                                    f"{', '.join(sorted(links)) or 'none'})")
            if not 0 < rc.gbps <= 1_000_000:
                raise SimInputError(f"--link-rate {rc.link}: the rate must be positive Gbit/s, got {rc.gbps}")

    def _kv_fraction(self, link: LinkSection) -> float:
        """Bytes that cross ``link`` per byte of KV under its codec (links[].kv_codec), at the profile's dtype;
        ``auto`` as its most compressive choice (an upper bound of what choosing per request gains). The
        codec's own time is not modelled: on a GPU it codes at 75-210 GB/s (benchmarks/RESULTS.md)."""
        return link_kv_fraction(link.kv_codec, [KVCodec(c) for c in self.cfg.kv.auto_codecs],
                                DTYPE_BYTES[self.profile.dtype], self.block_size)

    def _sample(self, flow: Flow, sample: LinkSample) -> None:
        """A flow's last byte left: its sample, divided by its mean share of the link (as the router does)."""
        link = flow.link.name
        share = self.meter.end(flow.crossing, self.clock.now)
        sample = LinkSample(sample.at, sample.gbps / share, sample.bound, sample.rtt_ms, share)
        self.meter.observe(link, sample)
        fig = self.meter.status(link)
        self.samples.append((link, sample, fig.gbps if fig is not None else 0.0))

    def link_between(self, a: str, b: str) -> SimLink:
        return self.local[a] if a == b else self.links[frozenset((a, b))]

    # -- running ---------------------------------------------------------
    def run(self, arrivals: list[SimArrival]) -> list[RequestRecord]:
        for a in arrivals:
            rec = RequestRecord(a.index, a.arrival_s, a.arrival_s, a.prompt_tokens, a.max_tokens)
            self.records.append(rec)
            if a.prompt_tokens + a.max_tokens > self.capacity_tokens:
                rec.error = (f"INVALID_ARGUMENT: prompt + max_tokens ({a.prompt_tokens + a.max_tokens} tokens) "
                             f"exceeds a worker's context or KV cache ({self.capacity_tokens} tokens)")
                continue
            req = SimRequest(a, a.chain(self.block_size), rec, f"sim-{a.index}", router=a.index % self.sim.routers)
            self.clock.at(a.arrival_s + self.sim.router_s, self._place, req)
        for f in self.sim.failures:
            self.clock.at(f.at_s, self._fail, f)
        for rc in self.sim.rate_changes:
            self.clock.at(rc.at_s, self._named_link(rc.link).set_rate, rc.gbps)
        self.clock.run()
        for rec in self.records:
            if rec.end_s is None and rec.error is None:
                rec.error = "unfinished: the simulation ended with the request still in flight"
        return self.records

    def _fail_request(self, req: SimRequest, why: str) -> None:
        req.record.error = why
        self.active.pop(req.rid, None)

    @staticmethod
    def _add(counts: dict[str, int], wid: str, delta: int) -> None:
        n = counts.get(wid, 0) + delta
        if n:
            counts[wid] = n
        else:
            counts.pop(wid, None)

    def _count(self, req: SimRequest, w: SimWorker, delta: int) -> None:
        """``req``'s router has ``delta`` more requests in flight on ``w``."""
        self._add(self.own[req.router], w.wid, delta)
        if req.router == self._shown:
            w.view.inflight += delta

    def _pend(self, req: SimRequest, p: SimWorker, tokens: int) -> None:
        """``req``'s router sent ``p`` a prompt of ``tokens`` to compute (0: its first token came back, or the
        attempt ended): the router's change to ``p``'s queue since ``p``'s last heartbeat."""
        delta, req.pending = tokens - req.pending, tokens
        if delta:
            since = self._since(req.router, p) + delta
            self.pend[req.router][p.wid] = (since, p.beats)
            if req.router == self._shown:
                p.show_pending(since)

    def _since(self, router: int, w: SimWorker) -> int:
        """``router``'s change to ``w``'s queue since ``w``'s last heartbeat."""
        since, beat = self.pend[router].get(w.wid, (0, -1))
        return since if beat == w.beats else 0

    def _show(self, router: int) -> None:
        """The views as ``router`` sees them: its own requests in flight and prompts not yet prefilled
        (only the workers either router has some on)."""
        if router == self._shown:
            return
        own, pend, old = self.own[router], self.pend[router], self._shown
        for wid in self.own[old].keys() | own.keys():
            self.workers[wid].view.inflight = own.get(wid, 0)
        for wid in self.pend[old].keys() | pend.keys():
            w = self.workers[wid]
            w.show_pending(self._since(router, w))
        self._shown = router

    def _place(self, req: SimRequest) -> None:
        a = req.arrival
        self._show(req.router)
        prompt = a.prompt_tokens + req.sent_tokens
        hashes = req.chain.upto(prompt // self.block_size)
        preq = PlacementRequest(prompt, self.index.leading_blocks(hashes), exclude=frozenset(req.exclude),
                                colocated_only=req.colocated_only)
        self.meter.refresh(self.clock.now)
        try:
            pl = place(preq, self.view, self.policy)
        except PlacementError as exc:
            if exc.full and req.queued_at is None:
                self._queue(req)
            elif not exc.full:
                if req.queued_at is not None:
                    self.waiting.remove(req)
                    req.queued_at = None
                self._fail_request(req, f"{'UNAVAILABLE' if exc.absent else 'RESOURCE_EXHAUSTED'}: {exc.message}")
            return
        d = self.workers[pl.decode.worker_id]
        p = self.workers[pl.prefill.worker_id] if pl.prefill is not None else None
        req.est_ttft_s = pl.est_ttft_s
        req.cached_prefill = pl.cached_blocks_prefill * self.block_size
        if not self._start(req, p, d, prompt):
            if req.queued_at is None:
                self._queue(req)
            return
        if req.queued_at is not None:
            self.waiting.remove(req)
            req.queued_at = None

    def _queue(self, req: SimRequest) -> None:
        req.queued_at = self.clock.now
        self.waiting.append(req)
        self.clock.after(self.cfg.router.admission.admission_wait_s, self._expire, req, req.queued_at)

    def _expire(self, req: SimRequest, queued_at: float) -> None:
        if req.queued_at == queued_at:
            self.waiting.remove(req)
            self._fail_request(req, "RESOURCE_EXHAUSTED: no room within router.admission.admission_wait_s")

    def _pump(self) -> None:
        """Tries the waiting requests in order until one still finds no room."""
        while self.waiting:
            head = self.waiting[0]
            self._place(head)
            if self.waiting and self.waiting[0] is head:
                return

    def _start(self, req: SimRequest, p: SimWorker | None, d: SimWorker, prompt: int) -> bool:
        """Starts an attempt on (p, d); False when d has no room for the prompt after all."""
        a = req.arrival
        max_tokens = a.max_tokens - req.sent_tokens
        d_seq = new_sequence(req.rid, prompt, max_tokens, req.chain)
        req.p, req.d, req.d_seq, req.p_seq, req.flow = p, d, d_seq, None, None
        self.active[req.rid] = req
        self._count(req, d, 1)
        if p is None:
            req.link, req.kv_bytes = "", 0
            d.add(d_seq)
            return True
        hit = d.reserve(d_seq)
        if hit is None:
            self._count(req, d, -1)
            self.active.pop(req.rid, None)
            return False
        self._count(req, p, 1)
        self._pend(req, p, max(0, prompt - req.cached_prefill))
        link = self.link_between(p.view.site, d.view.site)
        req.link = link.name
        req.kv_bytes = round((blocks_for(prompt, self.block_size) - hit) * self.kv_block_bytes * link.view.kv_fraction)
        req.flow = link.open(functools.partial(self._landed, req, d_seq))
        req.flow.crossing = self.meter.begin(link.name, self.clock.now)
        req.p_seq = new_sequence(req.rid, prompt, 1, req.chain)
        # the reservation's answer and the prefill call: two RPCs before P queues the prompt
        self.clock.after(2 * self.sim.rpc_s, self._prefill, req, req.p_seq)
        return True

    def _prefill(self, req: SimRequest, p_seq: SimSequence) -> None:
        if req.p_seq is p_seq and req.p is not None and req.p.alive:
            req.p.add(p_seq)

    def _step_started(self, w: SimWorker, out: SchedulerOutput, dur: float) -> None:
        """A prefill worker's step: each chunk's KV goes to its link as its layers finish."""
        if w.view.role is not Role.PREFILL:
            return
        for e in out.prefill:
            req = self.active.get(e.seq.request_id)
            if req is None or req.flow is None or req.p_seq is not e.seq:
                continue
            share = req.kv_bytes * e.num_new_tokens / max(1, e.seq.num_prompt_tokens - e.seq.num_cached_tokens)
            for k in range(LAYER_PIECES):
                self.clock.after(dur * (k + 1) / LAYER_PIECES, req.flow.link.add, req.flow, share / LAYER_PIECES)

    def _token(self, w: SimWorker, seq: Sequence, last: bool) -> None:
        req = self.active.get(seq.request_id)
        if req is None:
            return
        if w.view.role is Role.PREFILL:
            if req.p_seq is seq and req.flow is not None:
                self._pend(req, w, 0)
                req.transfer_s = self.clock.now  # what the prefill worker reports: its wait after the prefill
                req.flow.link.close(req.flow)
            return
        if req.d_seq is not seq:
            return
        rec = req.record
        rec.token_times.append(self.clock.now + self.sim.rpc_s)
        if last:
            rec.end_s = rec.token_times[-1]
            rec.cached_tokens = (req.p_seq or seq).num_cached_tokens
            rec.placement = self._placement(req)
            self._count(req, w, -1)
            self.active.pop(req.rid, None)
            self._pump()

    def _landed(self, req: SimRequest, d_seq: SimSequence, ok: bool) -> None:
        """The flow of ``d_seq``'s prompt ended: all of it arrived (ok) or its link failed."""
        if req.d_seq is not d_seq or self.active.get(req.rid) is not req:
            return
        p, d = req.p, req.decode_worker
        if p is None:  # KV flows only from a prefill worker
            raise RuntimeError(f"request {req.rid}: KV landed for an attempt without a prefill worker")
        self._pend(req, p, 0)
        if p.alive:
            self._count(req, p, -1)
            p.release(req.prefill_sequence)
        req.transfer_s = self.clock.now - req.transfer_s
        if req.flow is not None:
            self.meter.end(req.flow.crossing, self.clock.now)  # a failed flow (a landed one ended when timed)
        if ok:
            d.commit(d_seq)
            return
        req.retries += 1
        self._count(req, d, -1)
        d.release(d_seq)
        req.exclude.add(p.view.worker_id)
        self.active.pop(req.rid, None)
        self._place(req)

    def _placement(self, req: SimRequest) -> dict:
        p, d = req.p, req.decode_worker
        return {"prefill_site": (p or d).view.site, "decode_site": d.view.site,
                "prefill_worker": (p or d).view.worker_id, "decode_worker": d.view.worker_id,
                "colocated": p is None, "link": req.link if p is not None else "",
                "transport": "" if p is None else "sim", "kv_bytes": req.kv_bytes if p is not None else 0,
                "kv_transfer_ms": req.transfer_s * 1e3 if p is not None else 0.0,
                "estimated_ttft_ms": req.est_ttft_s * 1e3, "router_ttft_ms": 0.0,
                "retries": req.retries, "migrations": req.migrations}

    # -- failures --------------------------------------------------------
    def _fail(self, f: Failure) -> None:
        if f.kind == "worker":
            self._worker_down(self.workers[f.target])
        else:
            link = self._named_link(f.target)  # checked in __init__
            link.view.up = False
            link.fail_all()
            if f.for_s is not None:
                self.clock.after(f.for_s, setattr, link.view, "up", True)

    def _named_link(self, name: str) -> SimLink:
        return next(ln for ln in self.links.values() if ln.name == name)

    def _worker_down(self, w: SimWorker) -> None:
        w.die()
        self.index.remove_worker(w.wid)
        for req in [r for r in self.active.values() if w in (r.p, r.d)]:
            p, d = req.p, req.decode_worker
            if req.flow is not None and not req.flow.over:
                req.flow.link.cancel(req.flow)
                self.meter.end(req.flow.crossing, self.clock.now)
            if p is not None:
                self._pend(req, p, 0)
            if p is not None and p is not w:
                self._count(req, p, -1)
                p.release(req.prefill_sequence)
            if d is not w:
                self._count(req, d, -1)
                d.release(req.decode_sequence)
            if d is w:
                req.migrations += 1
            else:
                req.retries += 1
            req.exclude.add(w.wid)
            self.active.pop(req.rid, None)
            self._place(req)
