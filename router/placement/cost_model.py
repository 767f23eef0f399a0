"""The ``cost_model`` policy's choice as vector operations over the view's columns
(router/placement/views.py): the TTFT model's terms (router/placement/estimate.py)
over every candidate at once, with the candidate order and random draws of the
earlier one-worker-at-a-time code (a test keeps the choices identical to it).

For N workers over S sites: eligibility is a few masks over N rows; the
best prefill per site is one scatter-min; the disaggregated cost of every
(decode site, blocks the decode worker holds) pair against every prefill
site is one S x K matrix; each decode worker then costs O(1) vector work.
"""

from __future__ import annotations

import random

import numpy as np

from kvrelay.router.placement.estimate import (
    admission_s,
    colocated_s,
    disaggregated_s,
    exposed_s,
    prefill_s,
    throughputs,
)
from kvrelay.router.placement.filters import Eligible
from kvrelay.router.placement.views import ClusterView


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
    """For each decode row (its site, its cached blocks): the best queue(P) + compute(P) +
    exposed transfer over the prefill sites (in their first-seen order: the first of equal
    costs wins) and that site (-1: none linked)."""
    pair_site, pair_cached, inverse = _pairs(d_site, d_cached, len(view.table.sites))
    gbps, rtt = view.link_matrix(req.coded_kv)
    g, r = gbps[np.ix_(p_sites, pair_site)], rtt[np.ix_(p_sites, pair_site)]
    with np.errstate(invalid="ignore"):
        a = a_site[:, None]
        cost = a + exposed_s(req.prompt_tokens, pair_cached, view, g, r, a)
    cost = np.where(np.isnan(cost), np.inf, cost)
    best = np.argmin(cost, axis=0)
    best_cost = cost[best, np.arange(cost.shape[1])]
    site = np.where(np.isfinite(best_cost), p_sites[best], -1)
    return best_cost[inverse], site[inverse]


def _layout_groups(d_layout: np.ndarray, p_layout: np.ndarray, num_layouts: int):
    """(decode mask, prefill mask) per KV layout both sides have: a prefill and a
    decode worker exchange KV only when their layouts are equal."""
    if num_layouts == 1:
        yield slice(None), slice(None)
        return
    for code in np.intersect1d(d_layout, p_layout):
        yield d_layout == code, p_layout == code


def _best_by_site(req, view: ClusterView, a: np.ndarray, site_of: np.ndarray, d_site: np.ndarray,
                  d_cached: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per decode row: the cheapest queue + compute + exposed transfer over the sites of the
    prefill rows (``a``: each one's queue and compute, ``site_of``: its site) and that site."""
    a_best = np.full(len(view.table.sites), np.inf)
    np.minimum.at(a_best, site_of, a)
    first = np.full(len(a_best), len(site_of))
    np.minimum.at(first, site_of, np.arange(len(site_of)))
    seen = np.flatnonzero(first < len(site_of))
    p_sites = seen[np.argsort(first[seen], kind="stable")]  # in first-seen order
    return _disaggregated(req, view, a_best[p_sites], p_sites, d_site, d_cached)


def _near(costs: np.ndarray, best: float, herd: float) -> np.ndarray:
    return costs <= best * (1 + herd) + 1e-4


def _most_cached(idx: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """Among near-equal candidates, those holding the most of the prompt."""
    return idx[cached == cached.max()]


def choose_cost_model(req, view: ClusterView, rows: Eligible, rng: random.Random,
                      disaggregate: bool) -> tuple[int, int | None]:
    """(decode row, prefill row or None for colocated) of the cheapest candidate."""
    c, bs, prompt = view.table.cols, view.block_size, req.prompt_tokens
    tput = throughputs(view)
    d = rows.decode
    own = prefill_s(0, prompt, rows.cached[d], bs, tput[d])
    admit = admission_s(c.waiting[d], c.decode_step_s[d])
    colocated = colocated_s(own, c.running[d], c.queued_prefill_tokens[d], tput[d], admit)
    p = rows.prefill
    dis = np.full(len(d), np.inf)
    dis_site = np.full(len(d), -1)
    a = np.zeros(len(p))
    site_of = view.table.site[p]
    lay = view.table.layout
    if disaggregate and len(p):
        a = prefill_s(c.queued_prefill_tokens[p], prompt, rows.cached[p], bs, tput[p])
        for dm, pm in _layout_groups(lay[d], lay[p], view.table.num_layouts):
            cost, site = _best_by_site(req, view, a[pm], site_of[pm], view.table.site[d[dm]], rows.cached[d[dm]])
            dis[dm], dis_site[dm] = disaggregated_s(cost, admit[dm]), site
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
    in_site = (site_of == site) & (lay[p] == lay[d[j]])
    ps = np.flatnonzero(in_site & _near(a, a[in_site].min(), view.herd_tolerance))
    ps = _most_cached(ps, rows.cached[p[ps]])
    return int(d[j]), int(p[ps[rng.randrange(len(ps))]])
