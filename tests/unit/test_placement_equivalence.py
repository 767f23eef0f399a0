"""``place`` (vectorized over the view's columns) chooses exactly what the
earlier one-worker-at-a-time implementation chose (kept as
tests/unit/placement_reference.py, verbatim but for one deliberate change
made to both since: ties among decode workers and among prefill workers
rotate on counters of their own): same workers, same estimate, same
errors, for every policy, over random views and request sequences with the
same seed (so the random tie-breaking draws match one for one)."""

from __future__ import annotations

import random

import pytest

from kvrelay.router.placement import place as new
from kvrelay.runtime.roles import Role
from tests.unit import placement_reference as old

JURISDICTIONS = ("CA-ON", "CA-QC", "EU", "US")


def _views(rng: random.Random):
    n_sites = rng.randint(1, 6)
    sites = [f"s{i}" for i in range(n_sites)]
    jur = {s: rng.choice(JURISDICTIONS) for s in sites}
    links_spec = {}
    for i in range(n_sites):
        for j in range(i + 1, n_sites):
            if rng.random() < 0.7:
                links_spec[frozenset((sites[i], sites[j]))] = (rng.choice([1.0, 8.0, 40.0, 120.0]),
                                                               rng.choice([0.5, 10.0, 100.0]), rng.random() < 0.85)
    workers = []
    for k in range(rng.randint(1, 120)):
        site = rng.choice(sites)
        role = rng.choice([Role.PREFILL, Role.DECODE])
        workers.append(dict(
            worker_id=f"{site}/{role.value}/{k}", role=role, site=site, healthy=rng.random() < 0.9,
            draining=rng.random() < 0.05, inflight=rng.randrange(0, 70), max_inflight=64,
            queued_prefill_tokens=rng.choice([0, 0, rng.randrange(0, 60_000)]), running=rng.randrange(0, 64),
            waiting=rng.randrange(0, 6), free_blocks=rng.choice([rng.randrange(0, 400), rng.randrange(0, 50_000)]),
            prefill_tokens_per_s=rng.choice([0.0, 800.0, 2000.0, 30_000.0]),
            decode_step_s=rng.choice([0.0, 0.01, 0.03]),
            tenants=frozenset({"alpha"}) if rng.random() < 0.1 else frozenset()))
    kw = dict(block_size=16, kv_block_bytes=rng.choice([16 * 23040, 16 * 131072]), num_layers=rng.choice([30, 32]),
              default_prefill_tokens_per_s=1000.0, colocate_below_tokens=rng.choice([0, 32]),
              herd_tolerance=rng.choice([0.0, 0.05, 0.3]), max_prefill_queue_s=rng.choice([float("inf"), 15.0]))
    local_gbps = rng.choice([10.0, 100.0])
    views = []
    for mod in (old, new):
        links = {k: mod.LinkView(r, g, up, name="-".join(sorted(k))) for k, (r, g, up) in links_spec.items()}
        views.append(mod.ClusterView([mod.WorkerView(**w) for w in workers], dict(jur), links,
                                     mod.LinkView(0.2, local_gbps), **kw))
    return views


def _request(rng: random.Random, mod, ids: list[str]):
    cached = {w: rng.randrange(0, 600) for w in rng.sample(ids, k=min(len(ids), rng.randrange(0, 8)))}
    allowed = None if rng.random() < 0.6 else frozenset(rng.sample(JURISDICTIONS, k=rng.randint(1, 2)))
    return mod.PlacementRequest(
        rng.choice([5, 40, 300, 2000, 8192, 30_000]), cached, allowed,
        deadline_s=None if rng.random() < 0.8 else rng.choice([0.05, 1.0, 30.0]),
        exclude=frozenset(rng.sample(ids, k=min(len(ids), rng.randrange(0, 3)))),
        colocated_only=rng.random() < 0.05, tenant=rng.choice(["", "alpha", "beta"]),
        reserve=rng.choice([0, 0, 1]))


def _outcome(mod, policy, req, view):
    try:
        p = mod.place(req, view, policy)
    except mod.PlacementError as exc:
        return ("error", exc.kind.value, exc.message, exc.retry_after_s, exc.wait.name)
    return (p.decode.worker_id, p.prefill.worker_id if p.prefill else None, p.est_ttft_s, p.policy,
            p.cached_blocks_prefill, p.cached_blocks_decode, p.link and (p.link.rtt_ms, p.link.gbps))


@pytest.mark.parametrize("policy", new.POLICIES)
def test_place_chooses_as_the_previous_implementation(policy):
    choices = errors = 0
    for case in range(60):
        rng = random.Random(case)
        old_view, new_view = _views(rng)
        ids = [w.worker_id for w in old_view.workers]
        p_old, p_new = old.make_policy(str(policy), case), new.make_policy(str(policy), case)
        for i in range(40):
            seed = rng.random()
            got_old = _outcome(old, p_old, _request(random.Random(seed), old, ids), old_view)
            got_new = _outcome(new, p_new, _request(random.Random(seed), new, ids), new_view)
            assert got_new == got_old, (case, i)
            errors += got_old[0] == "error"
            choices += got_old[0] != "error"
    assert choices > 500 and errors > 50  # both paths were exercised


def test_decode_pairs_are_np_unique_in_both_regimes():
    """cost_model groups decode rows by (site, cached blocks): a dense table
    when that space is small, np.unique otherwise; both give np.unique's answer."""
    import numpy as np

    from kvrelay.router.placement.cost_model import _pairs

    rng = np.random.default_rng(3)
    for n, sites, deepest in ((5000, 10, 300), (50, 10, 2000), (1, 1, 0), (300, 100, 40)):
        site, cached = rng.integers(0, sites, n), rng.integers(0, deepest + 1, n)
        span = int(cached.max()) + 1
        keys, inverse = np.unique(site * span + cached, return_inverse=True)
        got_site, got_cached, got_inverse = _pairs(site, cached, sites)
        assert got_site.tolist() == (keys // span).tolist() and got_cached.tolist() == (keys % span).tolist()
        assert got_inverse.tolist() == inverse.ravel().tolist()
