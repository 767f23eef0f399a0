"""Placement's hot path as vector operations over the view's columns
(router/placement/views.py): which workers are eligible, and the ``cost_model``
policy's choice, with exactly the arithmetic, candidate order and random
draws of the per-worker formulas in router/placement/place.py's docstring (a test
keeps the choices identical to the earlier one-worker-at-a-time code).

For N workers over S sites: eligibility is a few masks over N rows; the
best prefill per site is one scatter-min; the disaggregated cost of every
(decode site, blocks the decode worker holds) pair against every prefill
site is one S x K matrix; each decode worker then costs O(1) vector work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from kvrelay.engine.blocks import blocks_for
from kvrelay.router.placement.views import ClusterView

DISAGG_OVERHEAD_S = 0.002
"""Extra RPCs of a disaggregated request (reservation, prefill call), measured
on loopback at ~1-3 ms; charged to every disaggregated candidate."""
_EMPTY = np.zeros(0, np.int64)


@dataclass(slots=True)
class Eligible:
    """Rows (in view order) the request may use, and the prompt's leading
    blocks each row holds (from the prefix index)."""

    prefill: np.ndarray
    decode: np.ndarray
    cached: np.ndarray


def _throughput(view: ClusterView) -> np.ndarray:
    tps = view.table.cols.prefill_tokens_per_s
    return np.where(tps != 0, tps, view.default_prefill_tokens_per_s)


def eligible_rows(req, view: ClusterView) -> Eligible:
    """The hard constraints: health, draining, exclusions, dedicated pools,
    jurisdiction, room, the prefill queue's bound, free blocks at the decode worker."""
    t = view.table
    c = t.cols
    cached = t.cached(req.cached_blocks)
    ok = c.healthy & ~c.draining
    for wid in req.exclude:
        r = t.row.get(wid)
        if r is not None:
            ok[r] = False
    if t.dedicated.any():
        ok &= t.serves(req.tenant)
    if req.allowed_jurisdictions is not None:
        site_ok = np.array([view.jurisdiction.get(s) in req.allowed_jurisdictions for s in t.sites], np.bool_)
        ok &= site_ok[t.site] if len(site_ok) else ok
    ok &= c.inflight + req.reserve < c.max_inflight
    need = blocks_for(req.prompt_tokens + 1, view.block_size)
    decode = np.flatnonzero(t.decode & ok & (c.free_blocks >= need - cached))
    if req.colocated_only:
        return Eligible(_EMPTY, decode, cached)
    queue_ok = c.queued_prefill_tokens / _throughput(view) <= view.max_prefill_queue_s
    return Eligible(np.flatnonzero(t.prefill & ok & queue_ok), decode, cached)


def _pairs(d_site: np.ndarray, d_cached: np.ndarray, n_sites: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (site, cached blocks) pairs of the decode rows, in
    ascending (site, cached) order (as ``np.unique`` would give them), and
    each row's pair: dense tables over the sites and the distinct depths, no sort
    (``d_cached`` has at least one row: placement has a decode candidate)."""
    span = int(d_cached.max()) + 1 if len(d_cached) else 1
    seen = np.zeros(span, np.bool_)
    seen[d_cached] = True
    depths = np.flatnonzero(seen)
    code = np.zeros(span, np.int64)
    code[depths] = np.arange(len(depths))
    key = d_site * len(depths) + code[d_cached]
    present = np.zeros(n_sites * len(depths), np.bool_)
    present[key] = True
    keys = np.flatnonzero(present)
    slot = np.zeros(len(present), np.int64)
    slot[keys] = np.arange(len(keys))
    return keys // len(depths), depths[keys % len(depths)], slot[key]


def _disaggregated(req, view: ClusterView, a_site: np.ndarray, p_sites: np.ndarray, d_site: np.ndarray,
                   d_cached: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each decode row (its site, its cached blocks): the best disaggregated
    cost over the prefill sites (in their first-seen order: the first of equal
    costs wins) and that site (-1: none linked)."""
    pair_site, pair_cached, inverse = _pairs(d_site, d_cached, len(view.table.sites))
    gbps, rtt = view.link_matrix()
    g, r = gbps[np.ix_(p_sites, pair_site)], rtt[np.ix_(p_sites, pair_site)]
    blocks = np.maximum(0, blocks_for(req.prompt_tokens, view.block_size) - pair_cached)
    with np.errstate(invalid="ignore"):
        transfer = blocks * view.kv_block_bytes * 8 / (g * 1e9)
        a = a_site[:, None]
        cost = a + (np.maximum(transfer / view.num_layers, transfer - a) + r / 1e3) + DISAGG_OVERHEAD_S
    cost = np.where(np.isnan(cost), np.inf, cost)
    best = np.argmin(cost, axis=0)
    best_cost = cost[best, np.arange(cost.shape[1])]
    site = np.where(np.isfinite(best_cost), p_sites[best], -1)
    return best_cost[inverse], site[inverse]


def _near(costs: np.ndarray, best: float, herd: float) -> np.ndarray:
    return costs <= best * (1 + herd) + 1e-4


def _most_cached(idx: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """Among near-equal candidates, those holding the most of the prompt."""
    return idx[cached == cached.max()]


def choose_cost_model(req, view: ClusterView, rows: Eligible, rng: random.Random,
                      disaggregate: bool) -> tuple[int, int | None]:
    """(decode row, prefill row or None for colocated) of the cheapest candidate."""
    c, bs, prompt = view.table.cols, view.block_size, req.prompt_tokens
    tput = _throughput(view)
    d = rows.decode
    own = (prompt - np.minimum(rows.cached[d] * bs, prompt - 1)) / tput[d]
    admit = c.waiting[d] * c.decode_step_s[d]
    colocated = own + own * c.running[d] + c.queued_prefill_tokens[d] / tput[d] + admit
    p = rows.prefill
    dis = np.full(len(d), np.inf)
    dis_site = np.full(len(d), -1)
    if disaggregate and len(p):
        a = (c.queued_prefill_tokens[p] + prompt - np.minimum(rows.cached[p] * bs, prompt - 1)) / tput[p]
        site_of = view.table.site[p]
        a_best = np.full(len(view.table.sites), np.inf)
        np.minimum.at(a_best, site_of, a)
        first = np.full(len(a_best), len(site_of))
        np.minimum.at(first, site_of, np.arange(len(site_of)))
        seen = np.flatnonzero(first < len(site_of))
        p_sites = seen[np.argsort(first[seen], kind="stable")]  # in first-seen order
        cost, dis_site = _disaggregated(req, view, a_best[p_sites], p_sites, view.table.site[d], rows.cached[d])
        dis = cost + admit
    best = min(colocated.min(), dis.min())
    j_col = np.flatnonzero(_near(colocated, best, view.herd_tolerance))
    j_dis = np.flatnonzero(_near(dis, best, view.herd_tolerance) & (dis_site >= 0))
    keys = np.sort(np.concatenate([2 * j_col, 2 * j_dis + 1]))  # each decode row's colocated candidate first
    keys = _most_cached(keys, rows.cached[d[keys // 2]])
    key = int(keys[rng.randrange(len(keys))])
    j = key // 2
    if key % 2 == 0:
        return int(d[j]), None
    site = dis_site[j]
    in_site = site_of == site
    ps = np.flatnonzero(in_site & _near(a, a_best[site], view.herd_tolerance))
    ps = _most_cached(ps, rows.cached[p[ps]])
    return int(d[j]), int(p[ps[rng.randrange(len(ps))]])
