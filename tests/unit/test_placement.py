"""Placement policies on constructed cluster views (router/placement/place.py),
and the prefix index they read (router/placement/prefix_index.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.kvtransfer.base import KVCodec
from kvrelay.router.placement.place import (
    POLICIES,
    ClusterView,
    LinkView,
    PlacementError,
    PlacementRequest,
    WorkerView,
    estimate,
    make_policy,
    place,
)
from kvrelay.router.placement.prefix_index import PrefixIndex

KV_BLOCK = 2 * 30 * 12288  # SmolLM2-135M fp32: 720 KiB per 16-token block


def view(workers, jur=None, links=None, **kw) -> ClusterView:
    sites = {w.site for w in workers}
    return ClusterView(workers, jur or {s: "CA-ON" for s in sites}, links or {}, LinkView(0.2, 10.0),
                       block_size=16, kv_block_bytes=KV_BLOCK, num_layers=30, **kw)


def w(wid, role, site="a", **kw) -> WorkerView:
    return WorkerView(wid, role, site, prefill_tokens_per_s=kw.pop("tps", 1000.0), **kw)


# ------------------------------------------------------------- property test
@st.composite
def clusters(draw):
    n_sites = draw(st.integers(1, 4))
    sites = [f"s{i}" for i in range(n_sites)]
    jur = {s: draw(st.sampled_from(["CA-ON", "CA-QC", "EU"])) for s in sites}
    links = {}
    for i in range(n_sites):
        for j in range(i + 1, n_sites):
            if draw(st.booleans()):
                links[frozenset((sites[i], sites[j]))] = LinkView(draw(st.floats(0.1, 100)), draw(st.floats(0.1, 100)),
                                                                  up=draw(st.booleans()))
    workers = []
    for k in range(draw(st.integers(1, 12))):
        workers.append(WorkerView(
            f"w{k}", draw(st.sampled_from(["prefill", "decode"])), draw(st.sampled_from(sites)),
            healthy=draw(st.booleans()), draining=draw(st.booleans()), inflight=draw(st.integers(0, 70)),
            queued_prefill_tokens=draw(st.integers(0, 50_000)), running=draw(st.integers(0, 64)),
            waiting=draw(st.integers(0, 10)), free_blocks=draw(st.integers(0, 5000)),
            prefill_tokens_per_s=draw(st.sampled_from([0.0, 50.0, 400.0, 20_000.0])),
            decode_step_s=draw(st.floats(0, 0.2)), layout=draw(st.sampled_from(["builtin", "builtin", "vllm"]))))
    cv = ClusterView(workers, jur, links, LinkView(0.2, 10.0), kv_block_bytes=KV_BLOCK, num_layers=30)
    allowed = draw(st.none() | st.frozensets(st.sampled_from(["CA-ON", "CA-QC", "EU", "US"]), max_size=2))
    cached = {wv.worker_id: draw(st.integers(0, 40)) for wv in workers if draw(st.booleans())}
    req = PlacementRequest(draw(st.integers(1, 20_000)), cached, allowed)
    return cv, req


@settings(max_examples=300, deadline=None)
@given(case=clusters(), policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**16))
def test_constraints_are_never_violated(case, policy, seed):
    cv, req = case
    usable = [x for x in cv.workers if x.healthy and not x.draining
              and (req.allowed_jurisdictions is None or cv.jurisdiction[x.site] in req.allowed_jurisdictions)]
    try:
        pl = make_policy(policy, seed).place(req, cv)
    except PlacementError as exc:
        allowed_decode = [x for x in usable if x.role == "decode"]
        if exc.kind == "constraint":  # truly nothing in the allowed jurisdictions
            assert not allowed_decode and req.allowed_jurisdictions is not None
        elif exc.kind == "unavailable":
            assert not [x for x in cv.workers if x.role == "decode" and x.healthy and not x.draining]
        else:
            assert exc.kind == "capacity" and exc.retry_after_s > 0
        return
    chosen = [pl.decode] + ([pl.prefill] if pl.prefill is not None else [])
    for x in chosen:
        assert x in usable, f"{x.worker_id} violates health, draining or residency"
        assert x.inflight < x.max_inflight
    assert pl.decode.role == "decode"
    if pl.prefill is not None:
        assert pl.prefill.role == "prefill"
        assert cv.link(pl.prefill.site, pl.decode.site) is not None, "placed across a missing or down link"
        assert pl.prefill.layout == pl.decode.layout, "paired workers whose KV layouts differ"
    assert pl.est_ttft_s > 0 and pl.policy == policy


# ------------------------------------------------------------ named cases
@pytest.mark.parametrize("policy", ["prefix_aware", "cost_model"])
def test_cached_prefix_wins_at_equal_load(policy):
    req_tokens = 1600
    ps = [w("p0", "prefill"), w("p1", "prefill")]
    ds = [w("d0", "decode", running=8), w("d1", "decode", running=8)]
    cv = view(ps + ds)
    for i in range(20):
        pl = make_policy(policy, i).place(PlacementRequest(req_tokens, {"p1": 90, "d1": 90}), cv)
        assert pl.decode.worker_id == "d1"
        assert pl.prefill is None or pl.prefill.worker_id == "p1"
    # and a prefill worker's cache alone decides the prefill worker
    for i in range(20):
        pl = make_policy(policy, i).place(PlacementRequest(req_tokens, {"p1": 90}), cv)
        assert pl.prefill is not None and pl.prefill.worker_id == "p1"


def test_huge_prompt_avoids_a_slow_link():
    workers = [w("p-slow", "prefill", "far"), w("p-fast", "prefill", "near"), w("d", "decode", "home", running=2)]
    links = {frozenset(("far", "home")): LinkView(60.0, 0.1), frozenset(("near", "home")): LinkView(5.0, 100.0)}
    cv = view(workers, links=links)
    for i in range(20):
        pl = make_policy("cost_model", i).place(PlacementRequest(16_000), cv)
        assert pl.prefill is not None and pl.prefill.worker_id == "p-fast"
    # the slow link alone: sending 720 MiB at 0.1 Gbit/s costs more than recomputing at a busy D
    cv = view([workers[0], workers[2]], links=links)
    pl = make_policy("cost_model", 0).place(PlacementRequest(16_000), cv)
    assert pl.colocated
    assert estimate(PlacementRequest(16_000), cv, workers[0], workers[2]) > 50


def test_a_coded_link_is_priced_at_its_coded_bytes_unless_the_tenant_forbids_lossy_codecs():
    """4000 tokens of SmolLM2's fp32 KV (176 MiB) over 0.2 Gbit/s take 7.4 s, more than P's 4 s of compute:
    3.4 s exposed, so a D that computes the prompt itself in 5.7 s wins. Under int8 (3.88x fewer bytes) the
    transfer hides behind the compute and the link wins; for a tenant with kv_lossy false it is every byte."""
    int8 = KVCodec.INT8.wire_fraction(4, 16)
    workers = [w("p", "prefill", "far"), w("d", "decode", "home", tps=700.0)]
    cv = view(workers, links={frozenset(("far", "home")): LinkView(30.0, 0.2, kv_fraction=int8)})
    coded, plain = PlacementRequest(4000), PlacementRequest(4000, coded_kv=False)
    assert estimate(plain, cv, *workers) - estimate(coded, cv, *workers) > 3.0
    pl = make_policy("cost_model", 0).place(coded, cv)
    assert pl.prefill is not None and pl.prefill.worker_id == "p"
    assert make_policy("cost_model", 0).place(plain, cv).colocated


@pytest.mark.parametrize("policy", POLICIES)
def test_short_prompt_goes_colocated(policy):
    cv = view([w("p", "prefill"), w("d", "decode", running=30)])
    assert make_policy(policy, 0).place(PlacementRequest(12), cv).colocated
    assert not make_policy(policy, 0).place(PlacementRequest(2000), cv).colocated


def test_busy_decode_worker_hands_prompts_to_the_prefill_pool_idle_one_keeps_cached_ones():
    cv = view([w("p", "prefill"), w("d", "decode", running=12)])
    assert not make_policy("cost_model", 0).place(PlacementRequest(800), cv).colocated
    # fully cached at D: nothing to compute or move -> colocated
    assert make_policy("cost_model", 0).place(PlacementRequest(800, {"d": 50}), cv).colocated


@pytest.mark.parametrize("policy", POLICIES)
def test_unhealthy_and_draining_workers_are_never_chosen(policy):
    workers = [w("p-sick", "prefill", healthy=False, tps=1e6), w("p-drain", "prefill", draining=True, tps=1e6),
               w("p-ok", "prefill", tps=10.0, queued_prefill_tokens=5000),
               w("d-sick", "decode", healthy=False), w("d-ok", "decode", running=60, inflight=30)]
    cv = view(workers)
    for i in range(30):
        pl = make_policy(policy, i).place(PlacementRequest(3000, {"p-sick": 100, "d-sick": 100}), cv)
        assert pl.decode.worker_id == "d-ok"
        assert pl.prefill is None or pl.prefill.worker_id == "p-ok"


def test_constraint_failure_names_the_jurisdictions():
    cv = view([w("p", "prefill", "mtl"), w("d", "decode", "mtl")], jur={"mtl": "CA-QC"})
    with pytest.raises(PlacementError) as err:
        make_policy("cost_model", 0).place(PlacementRequest(100, allowed_jurisdictions=frozenset({"EU"})), cv)
    assert err.value.kind == "constraint" and "EU" in err.value.message


def test_missing_workers_are_worth_waiting_for_only_where_sites_exist():
    """``absent``: the router waits (router.admission.unavailable_wait_s) for workers that may come back."""
    policy = make_policy("cost_model", 0)
    dead = view([w("p", "prefill", "mtl"), w("d", "decode", "mtl", healthy=False)], jur={"mtl": "CA-QC"})
    for allowed, kind in ((None, "unavailable"), (frozenset({"CA-QC"}), "unavailable")):
        with pytest.raises(PlacementError) as err:
            policy.place(PlacementRequest(100, allowed_jurisdictions=allowed), dead)
        assert (err.value.kind, err.value.absent) == (kind, True)
    two = view([w("d-on", "decode", "tor"), w("d-qc", "decode", "mtl", healthy=False)],
               jur={"tor": "CA-ON", "mtl": "CA-QC"})
    with pytest.raises(PlacementError) as err:  # Montreal's decode worker is down: it may come back
        policy.place(PlacementRequest(100, allowed_jurisdictions=frozenset({"CA-QC"})), two)
    assert (err.value.kind, err.value.absent) == ("constraint", True)
    with pytest.raises(PlacementError) as err:  # no site in the EU at all: nothing to wait for
        policy.place(PlacementRequest(100, allowed_jurisdictions=frozenset({"EU"})), two)
    assert (err.value.kind, err.value.absent) == ("constraint", False)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decode_worker_gets_kv_only_from_a_prefill_worker_of_its_layout(policy):
    """A vLLM pool beside a builtin pool: each decode worker pairs only with prefill
    workers of its own KV layout; with none, its requests are computed where they decode."""
    ps = [w("p-builtin", "prefill", layout="builtin"), w("p-vllm", "prefill", layout="vllm")]
    ds = [w("d-builtin", "decode", layout="builtin", running=60), w("d-vllm", "decode", layout="vllm", running=60)]
    cv = view(ps + ds)
    seen = set()
    pol = make_policy(policy, 0)
    for _ in range(16):
        pl = pol.place(PlacementRequest(4000), cv)
        assert pl.prefill is not None and pl.prefill.layout == pl.decode.layout
        seen.add((pl.prefill.worker_id, pl.decode.worker_id))
    assert seen <= {("p-builtin", "d-builtin"), ("p-vllm", "d-vllm")} and len(seen) == 2
    alone = view([ps[0], ds[1]])
    pl = make_policy(policy, 0).place(PlacementRequest(4000), alone)
    assert pl.colocated and pl.decode.worker_id == "d-vllm"


def test_free_blocks_are_counted_in_each_workers_own_block_size():
    """A vLLM decode worker counts 128-token blocks: 20 free hold a 2000-token prompt that
    125 of the view's 16-token blocks would not fit in 20."""
    vllm_d = w("d-vllm", "decode", block_size=128, free_blocks=20, running=50)
    builtin_d = w("d-builtin", "decode", free_blocks=20, running=50)
    pl = make_policy("least_loaded", 0).place(PlacementRequest(2000), view([w("p", "prefill"), vllm_d, builtin_d]))
    assert pl.decode.worker_id == "d-vllm"
    with pytest.raises(PlacementError):
        make_policy("least_loaded", 0).place(PlacementRequest(2600), view([vllm_d]))  # 21 blocks


def test_prefill_in_a_forbidden_jurisdiction_is_not_used_even_when_cheaper():
    cv = view([w("p-eu", "prefill", "ams", tps=1e6), w("d-qc", "decode", "mtl", running=40)],
              jur={"ams": "EU", "mtl": "CA-QC"}, links={frozenset(("ams", "mtl")): LinkView(80, 100)})
    pl = make_policy("cost_model", 0).place(PlacementRequest(5000, allowed_jurisdictions=frozenset({"CA-QC"})), cv)
    assert pl.colocated and pl.decode.worker_id == "d-qc"


def test_admission_full_workers_and_deadlines():
    cv = view([w("d", "decode", inflight=64)])
    with pytest.raises(PlacementError) as err:
        make_policy("cost_model", 0).place(PlacementRequest(100), cv)
    assert err.value.kind == "capacity" and err.value.retry_after_s > 0
    cv = view([w("d", "decode", free_blocks=10)])
    with pytest.raises(PlacementError):  # 100 blocks needed, 10 free
        make_policy("cost_model", 0).place(PlacementRequest(1600), cv)
    assert make_policy("cost_model", 0).place(PlacementRequest(1600, {"d": 95}), cv)  # cached blocks count
    cv = view([w("d", "decode", tps=100.0)])
    with pytest.raises(PlacementError) as err:
        make_policy("cost_model", 0).place(PlacementRequest(1000, deadline_s=0.5), cv)
    assert err.value.kind == "capacity" and "deadline" in err.value.message
    assert err.value.retry_after_s == pytest.approx(10.0 - 0.5, rel=0.01)
    cv = view([])
    with pytest.raises(PlacementError) as err:
        make_policy("round_robin", 0).place(PlacementRequest(10), cv)
    assert err.value.kind == "unavailable"


def test_round_robin_and_least_loaded_spread_requests():
    ws = [w("p0", "prefill"), w("p1", "prefill"), w("d0", "decode"), w("d1", "decode")]
    rr = make_policy("round_robin")
    got = [(pl.prefill.worker_id, pl.decode.worker_id)
           for pl in (rr.place(PlacementRequest(500), view(ws)) for _ in range(4))]
    assert {d for _, d in got} == {"d0", "d1"} and {p for p, _ in got} == {"p0", "p1"}
    ws[2].inflight = 5
    assert make_policy("least_loaded").place(PlacementRequest(500), view(ws)).decode.worker_id == "d1"


@pytest.mark.parametrize("policy", ["least_loaded", "prefix_aware"])
def test_ties_among_decode_workers_rotate_whatever_the_prefill_choice(policy):
    """Idle decode workers take turns even when each request also picks among
    prefill workers (a shared turn counter once sent every request to d0)."""
    ws = [w("p0", "prefill"), w("d0", "decode"), w("d1", "decode")]
    pol = make_policy(policy)
    got = [pol.place(PlacementRequest(500), view(ws)) for _ in range(6)]
    assert [pl.decode.worker_id for pl in got] == ["d0", "d1"] * 3
    assert {pl.prefill.worker_id for pl in got} == {"p0"}


def test_cost_model_spreads_equal_candidates():
    ws = [w(f"d{i}", "decode") for i in range(4)] + [w("p", "prefill")]
    pol = make_policy("cost_model", 1)
    chosen = {pol.place(PlacementRequest(400), view(ws)).decode.worker_id for _ in range(60)}
    assert len(chosen) == 4


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown placement policy"):
        make_policy("fastest")


# ------------------------------------------------------------- prefix index
def test_prefix_index_counts_leading_blocks_per_worker():
    ix = PrefixIndex()
    ix.apply("a", [1, 2, 3], [])
    ix.apply("b", [1, 2], [])
    ix.apply("c", [2, 3], [])  # holds later blocks but not the first: no leading blocks
    assert ix.leading_blocks([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert ix.leading_blocks([9, 1]) == {}
    ix.apply("a", [], [2])
    assert ix.leading_blocks([1, 2, 3]) == {"a": 1, "b": 2}
    ix.apply("b", [7], [], snapshot=True)  # replaces what b held
    assert ix.leading_blocks([1, 2]) == {"a": 1} and ix.leading_blocks([7]) == {"b": 1}
    ix.remove_worker("a")
    assert ix.leading_blocks([1]) == {} and ix.blocks_of("a") == 0


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.sets(st.integers(0, 30))), st.lists(st.integers(0, 30)))
def test_prefix_index_matches_a_direct_scan(holdings, prompt):
    ix = PrefixIndex()
    for wid, hs in holdings.items():
        ix.apply(wid, hs, [])
    expected = {}
    for wid, hs in holdings.items():
        n = 0
        while n < len(prompt) and prompt[n] in hs:
            n += 1
        if n:
            expected[wid] = n
    assert ix.leading_blocks(prompt) == expected


def test_registry_applies_cache_events_only_after_a_snapshot():
    import asyncio

    from kvrelay.router.cluster.registry import WorkerRegistry
    from kvrelay.runtime.config import parse_config
    from kvrelay.v1 import worker_pb2 as wpb

    async def scenario():
        reg = WorkerRegistry(parse_config({}))
        await reg.register(wpb.WorkerInfo(worker_id="local/decode/0", role=wpb.ROLE_DECODE, site="local",
                                          address="127.0.0.1:1", num_blocks=100))
        load = wpb.WorkerLoad(worker_id="local/decode/0", total_blocks=100, free_blocks=90)
        # changes without a snapshot first: the router cannot trust them, asks for one
        resp = reg.heartbeat(wpb.HeartbeatRequest(load=load, kv_events=wpb.KVCacheEvents(stored=[5])))
        assert resp.known and resp.send_snapshot and reg.index.blocks_of("local/decode/0") == 0
        resp = reg.heartbeat(wpb.HeartbeatRequest(load=load, kv_events=wpb.KVCacheEvents(stored=[1, 2], snapshot=True)))
        assert not resp.send_snapshot and reg.index.leading_blocks([1, 2]) == {"local/decode/0": 2}
        reg.heartbeat(wpb.HeartbeatRequest(load=load, kv_events=wpb.KVCacheEvents(stored=[3], removed=[2])))
        assert reg.index.leading_blocks([1, 2]) == {"local/decode/0": 1}
        view = reg.view()
        assert view.workers[0].free_blocks == 90 and view.workers[0].healthy
        assert not reg.heartbeat(wpb.HeartbeatRequest(load=wpb.WorkerLoad(worker_id="ghost"))).known
        await reg.close()

    asyncio.run(scenario())


def test_the_registry_view_follows_workers_coming_going_and_falling_silent():
    """The registry keeps one view: rebuilt when a worker registers or leaves
    (also while another registration is half done), health read from the
    heartbeat clock in one vector operation, a suspected worker unhealthy
    until it heartbeats again."""
    import asyncio

    from kvrelay.router.cluster.registry import WorkerRegistry
    from kvrelay.runtime.config import parse_config
    from kvrelay.v1 import worker_pb2 as wpb

    def info(i: int) -> wpb.WorkerInfo:
        return wpb.WorkerInfo(worker_id=f"local/decode/{i}", role=wpb.ROLE_DECODE, site="local",
                              address="127.0.0.1:1", num_blocks=100)

    async def scenario():
        # no stall of this machine's counts
        reg = WorkerRegistry(parse_config({"router": {"liveness": {"worker_timeout_s": 600}}}))
        await reg.register(info(0))
        first = reg.view()
        assert [w.worker_id for w in first.workers] == ["local/decode/0"] and reg.view() is first
        await reg.register(info(1))
        assert [w.worker_id for w in reg.view().workers] == ["local/decode/0", "local/decode/1"]
        reg.suspect("local/decode/1")
        assert [w.healthy for w in reg.view().workers] == [True, False]
        reg.heartbeat(wpb.HeartbeatRequest(load=wpb.WorkerLoad(worker_id="local/decode/1", total_blocks=100,
                                                               free_blocks=40)))
        view = reg.view()
        assert [w.healthy for w in view.workers] == [True, True] and view.workers[1].free_blocks == 40
        reg.workers["local/decode/0"].last_seen -= reg.timeout_s + 1  # silent past the timeout
        assert [w.healthy for w in reg.view().workers] == [False, True]
        await reg.deregister("local/decode/0")
        assert [w.worker_id for w in reg.view().workers] == ["local/decode/1"]
        await reg.register(info(1))  # the same worker again: a fresh record, a fresh row
        assert reg.view().workers[0] is reg.workers["local/decode/1"].row
        await reg.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", POLICIES)
def test_prefill_worker_with_a_queue_beyond_the_bound_takes_no_prompt(policy):
    # p-busy has 40 s of work queued (> 15 s): a reservation at D would outlive its lease
    ws = [w("p-busy", "prefill", tps=1000.0, queued_prefill_tokens=40_000),
          w("p-free", "prefill", tps=1000.0, queued_prefill_tokens=5_000), w("d", "decode")]
    v = view(ws, max_prefill_queue_s=15.0)
    for _ in range(10):
        pl = place(PlacementRequest(prompt_tokens=2000), v, make_policy(policy, seed=1))
        assert pl.prefill is None or pl.prefill.worker_id == "p-free"
    ws[1].queued_prefill_tokens = 20_000  # both over the bound: D computes the prompt itself
    assert place(PlacementRequest(prompt_tokens=2000), view(ws, max_prefill_queue_s=15.0),
                 make_policy(policy, seed=1)).prefill is None
