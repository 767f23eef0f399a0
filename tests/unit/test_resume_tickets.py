"""Resume tickets (router/core/resume.py): a stream resumes at another router only with the
ticket its last message carried, for the same tenant's same request after exactly those tokens,
within the ticket's lifetime; and what it resumes is charged and audited as computed prompt
(issue 56, finding 5: before, resume_token_ids were taken on the client's word, refunded at
release and left out of the audit record)."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.pipeline import RouterCore
from kvrelay.router.core.requests import Caller, ModelLimits
from kvrelay.router.core.resume import TICKET_BYTES, TICKET_TTL_S, ResumeTickets
from kvrelay.router.main import core_parts
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

LIMITS = ModelLimits(name="tiny", max_model_len=512, vocab_size=320)
WORK = wpb.WorkRequest(request_id="r-1", prompt_token_ids=[5, 6, 7], max_tokens=20, salt="s")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def refused(fn, *args) -> str:
    with pytest.raises(RouterError) as err:
        fn(*args)
    assert err.value.kind is ErrorKind.PERMISSION_DENIED
    return err.value.message


def test_a_ticket_resumes_its_own_stream_only():
    clock = Clock()
    tickets = ResumeTickets(b"k" * 32, clock)
    binding = tickets.bind("lab-a", "tiny", WORK)
    stream = tickets.stream(binding, [])
    stream.after([10, 11])
    ticket = stream.after([12])
    assert len(ticket) == TICKET_BYTES
    tickets.check(binding, [10, 11, 12], ticket, "lab-a")  # the stream so far: accepted
    other_router = wpb.WorkRequest()
    other_router.CopyFrom(WORK)
    other_router.request_id = "r-2"  # another router's random id for the same request
    tickets.check(tickets.bind("lab-a", "tiny", other_router), [10, 11, 12], ticket, "lab-a")
    assert "does not match" in refused(tickets.check, binding, [10, 11, 12, 13], ticket, "lab-a")  # more tokens
    assert "does not match" in refused(tickets.check, binding, [10, 11, 99], ticket, "lab-a")  # other tokens
    assert "does not match" in refused(tickets.check, tickets.bind("lab-b", "tiny", WORK), [10, 11, 12], ticket,
                                       "lab-b")  # another tenant
    longer = wpb.WorkRequest()
    longer.CopyFrom(WORK)
    longer.max_tokens = 400  # the same prompt asking for more
    assert "does not match" in refused(tickets.check, tickets.bind("lab-a", "tiny", longer), [10, 11, 12], ticket,
                                       "lab-a")
    forged = ResumeTickets(b"x" * 32, clock).stream(binding, [10, 11, 12])  # a key that is not the deployment's
    assert "does not match" in refused(tickets.check, binding, [10, 11, 12], forged.after([]), "lab-a")
    flipped = ticket[:-1] + bytes([ticket[-1] ^ 1])
    assert "does not match" in refused(tickets.check, binding, [10, 11, 12], flipped, "lab-a")
    assert "need the resume_ticket" in refused(tickets.check, binding, [10, 11, 12], b"", "lab-a")
    assert f"not the {TICKET_BYTES}" in refused(tickets.check, binding, [10, 11, 12], b"\x01" * 9, "lab-a")
    clock.now += TICKET_TTL_S + 1
    assert "issued 901 s ago" in refused(tickets.check, binding, [10, 11, 12], ticket, "lab-a")


def test_a_resumed_streams_tickets_cover_what_it_resumed_after():
    tickets = ResumeTickets(b"k" * 32, Clock())
    binding = tickets.bind("lab-a", "tiny", WORK)
    first = tickets.stream(binding, [])
    first.after([10])
    at_b = tickets.stream(binding, [10])  # the next router, resuming after [10]
    ticket = at_b.after([11, 12])
    tickets.check(binding, [10, 11, 12], ticket, "lab-a")  # a third router takes it on from there


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer(tiny_checkpoints["llama"])


def test_resumed_tokens_are_charged_and_audited_as_computed_prompt(tok):
    """A resumption with a real ticket: its tenant's token quota is charged the resumed tokens
    (prefilled as prompt), and its record counts them; without a ticket, or with one for fewer
    tokens, it is refused before any quota is touched."""
    cfg = parse_config({"router": {"admission": {"unavailable_wait_s": 0.01, "admission_wait_s": 0.01}},
                        "tenants": [{"name": "lab-a", "tokens_per_minute": 600}]})
    core = RouterCore(cfg, tok, LIMITS, core_parts(cfg))
    records: list[dict] = []
    core._audit = lambda record, kind=None: records.append(record)
    caller = Caller("lab-a")
    msg = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6, 7]), max_tokens=250)
    had = core.prepare(msg, caller)
    resume = [40 + i % 200 for i in range(200)]
    ticket = core.tickets.stream(had.binding, []).after(resume)
    bare = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6, 7]), max_tokens=250, resume_token_ids=resume)
    assert "need the resume_ticket" in refused(core.prepare, bare, caller)
    short = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6, 7]), max_tokens=250, resume_token_ids=resume[:-1],
                                resume_ticket=ticket)
    assert "does not match" in refused(core.prepare, short, caller)
    with pytest.raises(RouterError) as err:
        core.prepare(ipb.GenerateRequest(prompt="hi", resume_ticket=ticket), caller)
    assert err.value.kind is ErrorKind.INVALID and "without resume_token_ids" in err.value.message
    bare.resume_ticket = ticket
    req = core.prepare(bare, caller)

    async def go():
        with pytest.raises(RouterError):  # no workers here: it ends unserved, after its prefill was due
            async for _ in core.generate(req, caller, bare):
                pass
        await core.registry.close()

    asyncio.run(go())
    level = core.quotas.state["lab-a"].tokens.level
    assert level < 600 - 190, level  # charged 3 + 200 (before: 3, the resumed 200 refunded)
    assert records[-1]["prompt_tokens"] == 3 and records[-1]["resumed_tokens"] == 200
