"""The router core without any front end: typed requests and callers in,
typed errors out, and the adapters' mappings cover every error kind."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.router.core.admission import SHED_MIN_BACKLOG_S, SHED_WINDOW_S, FairQueue
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.pipeline import AdmissionWait, RouterCore, refusal
from kvrelay.router.core.recovery import Recovery
from kvrelay.router.core.requests import Caller, ModelLimits, Priority, parse_request
from kvrelay.router.frontends.grpc_api import STATUS
from kvrelay.router.frontends.openai_http import HTTP_STATUS, api_error
from kvrelay.router.main import core_parts
from kvrelay.router.placement.place import PlacementError, PlacementFailure, Wait
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.roles import Role
from kvrelay.runtime.topology import Topology, link_name
from kvrelay.v1 import inference_pb2 as ipb


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer(tiny_checkpoints["llama"])


LIMITS = ModelLimits(name="tiny", max_model_len=512, vocab_size=320)


def test_every_error_kind_has_a_grpc_and_an_http_status():
    assert set(STATUS) == set(ErrorKind) and set(HTTP_STATUS) == set(ErrorKind)
    assert STATUS[ErrorKind.OVERLOADED] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert HTTP_STATUS[ErrorKind.UNKNOWN_MODEL][0] == 404 and HTTP_STATUS[ErrorKind.OVERLOADED][0] == 429


def test_overload_carries_a_retry_hint_to_both_front_ends():
    err = refusal(PlacementError(PlacementFailure.CAPACITY, "every eligible decode worker is full", 1.5, Wait.ROOM))
    assert err.kind is ErrorKind.OVERLOADED and err.retry_after_s == 1.5 and "retry in 1500 ms" in err.message
    http = api_error(err)
    assert http.status == 429 and http.headers["Retry-After"] == "2" and http.code == "resource_exhausted"
    constraint = refusal(PlacementError(PlacementFailure.CONSTRAINT, "no site in FR"))
    assert (constraint.kind, constraint.retry_after_s) == (ErrorKind.CONSTRAINT, None)


def test_parse_request_refuses_with_typed_errors(tok):
    cases = [
        (ipb.GenerateRequest(prompt="hi", model="gpt-17"), ErrorKind.UNKNOWN_MODEL, "unknown model"),
        (ipb.GenerateRequest(prompt="hi", request_id="x" * 129), ErrorKind.INVALID, "longer than 128"),
        (ipb.GenerateRequest(prompt="hi", max_tokens=-1), ErrorKind.INVALID, "max_tokens must be >= 1"),
        (ipb.GenerateRequest(prompt="   "), ErrorKind.INVALID, "prompt is empty"),
        (ipb.GenerateRequest(), ErrorKind.INVALID, "no input"),
        (ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[1, 999])), ErrorKind.INVALID, "token ids must be in"),
        (ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[1] * 60), max_tokens=500), ErrorKind.INVALID, "exceeds"),
        (ipb.GenerateRequest(prompt="hi", max_tokens=2, resume_token_ids=[5, 6]), ErrorKind.INVALID,
         "resume_token_ids holds 2 tokens: max_tokens (2) counts them"),
        (ipb.GenerateRequest(prompt="hi", max_tokens=8, resume_token_ids=[5, 999]), ErrorKind.INVALID,
         "resume_token_ids must be in"),
    ]
    for msg, kind, text in cases:
        with pytest.raises(RouterError) as err:
            parse_request(msg, tok, LIMITS)
        assert err.value.kind is kind and text in err.value.message, (msg, err.value)


def test_parse_request_salts_by_tenant_and_keeps_the_client_id(tok):
    req = parse_request(ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6, 7]), request_id="mine", max_tokens=3,
                                            allowed_jurisdictions=["CA-ON"]), tok, LIMITS, salt="lab-a")
    assert req.client_id == "mine" and req.work.request_id.startswith("mine-") and req.work.salt == "lab-a"
    assert list(req.work.prompt_token_ids) == [5, 6, 7] and req.work.max_tokens == 3
    assert req.allowed_jurisdictions == frozenset({"CA-ON"})
    anywhere = parse_request(ipb.GenerateRequest(prompt="hello"), tok, LIMITS)
    assert anywhere.allowed_jurisdictions is None and anywhere.client_id == anywhere.work.request_id
    assert anywhere.resume == []


def test_a_resumed_request_continues_after_what_the_client_has(tok):
    req = parse_request(ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6, 7]), max_tokens=10,
                                            resume_token_ids=[8, 9]), tok, LIMITS)
    run = Recovery(req.work)
    run.resume(req.resume)
    first = run.work_request()  # as a migrated stream: prompt + what was sent, the rest of max_tokens
    assert list(first.prompt_token_ids) == [5, 6, 7, 8, 9] and first.max_tokens == 8
    assert first.prior_output_tokens == 2 and run.migrations == 0


def test_caller_deadline():
    assert Caller().time_remaining() is None
    c = Caller.with_timeout("lab-a", 10.0, Priority.BATCH)
    assert 9.0 < c.time_remaining() <= 10.0 and c.priority is Priority.BATCH
    assert Caller(deadline=time.monotonic() - 5).time_remaining() == 0.0


def _core(tok, **admission) -> RouterCore:
    cfg = parse_config({"router": {"admission": {"unavailable_wait_s": 0.4, "admission_wait_s": 0.4, **admission}}})
    return RouterCore(cfg, tok, LIMITS, core_parts(cfg))


def test_core_waits_for_workers_then_is_unavailable(tok):
    async def go():
        core = _core(tok)
        caller = Caller("lab-a")
        req = core.prepare(ipb.GenerateRequest(prompt="hello", max_tokens=2), caller)
        t0 = time.monotonic()
        with pytest.raises(RouterError) as err:
            async for _ in core.generate(req, caller):
                pass
        took = time.monotonic() - t0
        await core.registry.close()
        return err.value, took

    err, took = asyncio.run(go())
    assert err.kind is ErrorKind.UNAVAILABLE and "no healthy decode worker" in err.message
    assert 0.3 <= took < 10.0  # it waited (unavailable_wait_s) instead of refusing at once


def test_core_never_waits_past_the_callers_deadline(tok):
    async def go():
        core = _core(tok, unavailable_wait_s=30.0)
        caller = Caller.with_timeout("", 0.3)
        req = core.prepare(ipb.GenerateRequest(prompt="hello", max_tokens=2), caller)
        t0 = time.monotonic()
        with pytest.raises(RouterError) as err:
            async for _ in core.generate(req, caller):
                pass
        await core.registry.close()
        return err.value, time.monotonic() - t0

    err, took = asyncio.run(go())
    assert err.kind is ErrorKind.UNAVAILABLE and took < 10.0  # bounded by the 0.3 s deadline, not the 30 s wait


def test_admission_wait_tells_what_waiting_can_bring(tok):
    async def go():
        cfg = parse_config({"router": {"admission": {"admission_wait_s": 5.0, "unavailable_wait_s": 0.01}}})
        w = AdmissionWait(cfg.router.admission, Caller())
        return w.allows(Wait.ROOM), w.allows(Wait.WORKERS), w.allows(Wait.NOTHING)

    assert asyncio.run(go()) == (True, False, False)


def test_the_queue_estimates_a_new_requests_wait_from_the_rate_it_is_served():
    """What early shedding reads: unknown until the queue has had a backlog for SHED_MIN_BACKLOG_S and served
    a few (or a whole window passed); then the tickets ahead of a new one (its class or better) divided by the
    tickets served per second of backlog."""
    async def go():
        q = FairQueue()

        def full():
            raise PlacementError(PlacementFailure.CAPACITY, "every decode worker is full", 1.0, Wait.ROOM)

        for _ in range(6):
            q.ticket("lab-a", 1, True, 1.0, 10.0, "same", full)
        q.ticket("lab-b", 1, False, 1.0, 10.0, "same", full)  # a batch request
        now = asyncio.get_running_loop().time()
        unknown = q.expected_wait(6, now)
        q._backlog_since = now - SHED_MIN_BACKLOG_S - 1.0
        q._served.append(now - 1.0)
        one_served = q.expected_wait(6, now)  # one served in three seconds: long requests, not a measure
        q._backlog_since = now - 10.0
        q._served.extend([now - 9.0, now - 5.0])  # three served in ten seconds of backlog
        known = q.expected_wait(q.ahead_of(1, True), now)
        q._backlog_since, q._served = now - SHED_WINDOW_S, type(q._served)()
        stalled = q.expected_wait(0, now)
        ahead = q.ahead_of(1, True), q.ahead_of(1, False), q.ahead_of(0, True)
        for t in list(q.waiting):
            q.withdraw(t)
        return unknown, one_served, known, stalled, ahead, q._backlog_since

    unknown, one_served, (wait, rate), (stalled_wait, stalled_rate), ahead, since = asyncio.run(go())
    assert unknown is None and one_served is None  # nobody is shed on no measure
    assert rate == pytest.approx(0.3) and wait == pytest.approx(7 / 0.3)  # behind 6 interactive tickets
    assert stalled_rate == 0.0 and stalled_wait == float("inf")  # nothing served in a whole window of backlog
    assert ahead == (6, 7, 0)  # a batch request waits behind the interactive ones; a better class behind none
    assert since is None  # the queue empty: the next backlog is measured anew


def test_shedding_early_is_on_by_default_and_may_be_turned_off():
    assert parse_config({}).router.admission.shed_early is True
    assert parse_config({"router": {"admission": {"shed_early": False}}}).router.admission.shed_early is False


def test_roles_and_links():
    assert Role.of(Role.PREFILL.proto) is Role.PREFILL and Role.of(Role.DECODE.proto) is Role.DECODE
    assert Role.DECODE == "decode"
    with pytest.raises(ValueError, match="prefill or decode"):
        Role.of(0)
    cfg = parse_config({"sites": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
                        "links": [{"between": ["a", "b"], "rtt_ms": 9, "protection": "integrity", "transport": "tcp"}]})
    topo = Topology(cfg)
    assert link_name("b", "a") == "a-b" and link_name("a", "a") == "local"
    ab = topo.link("a", "b")
    assert ab is topo.link("b", "a") and ab.rtt_ms == 9 and topo.link("a", "c") is None
    assert topo.link("c", "c") is cfg.local_link
    assert topo.protection(ab) == "integrity" and topo.protection(cfg.local_link) == "aead"
    # a receiver enforces the link its sender's certificate names; without one, the strongest into its site
    assert topo.required_protection("a", "b") == "integrity" and topo.required_protection("a", "a") == "aead"
    assert topo.required_protection("b", None) == "aead"
    assert topo.transport(ab, "nixl") == "tcp" and topo.transport(cfg.local_link, "nixl") == "nixl"


def test_prepare_hashes_the_prompt_and_a_migration_extends_the_chain(tok):
    """The prompt's block hashes are made with its tokens (in the tokenizer
    threads), in the tenant's domain; a migrated attempt, whose prompt also
    carries the tokens already sent, hashes only the blocks those add."""
    from kvrelay.engine.hashing import hash_blocks

    async def go():
        core = _core(tok)
        req = core.prepare(ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=list(range(1, 41))), max_tokens=60),
                           Caller("lab-a"))
        bs = core.cfg.cache.block_size
        work = req.work
        assert req.block_hashes == hash_blocks(list(work.prompt_token_ids), bs, work.salt) and work.salt
        assert core._block_hashes(req, work) is req.block_hashes
        moved = type(work)()
        moved.CopyFrom(work)
        moved.prompt_token_ids.extend(range(100, 100 + 2 * bs))
        assert core._block_hashes(req, moved) == hash_blocks(list(moved.prompt_token_ids), bs, work.salt)
        await core.registry.close()
        return len(req.block_hashes)

    assert asyncio.run(go()) == 40 // parse_config({}).cache.block_size
