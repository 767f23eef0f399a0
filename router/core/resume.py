"""Resume tickets: proof that a tenant really had the stream it asks to resume.

A client whose router went away mid-stream asks another router to continue after
the tokens it received (``GenerateRequest.resume_token_ids``). Those tokens are
prefilled as part of the prompt, so taken on the client's word they would be
prompt computed outside the tenant's quotas and its audit record: a tenant could
send a context window as "already received" and pay two tokens. So every message
that carries tokens also carries a ticket (``GenerateResponse.resume_ticket``)
that any router of the deployment can check, and a resumption needs the last one:

    ticket = version | issued (u64, s) | HMAC-SHA256(key, request | SHA-256(tokens so far) | count | issued)

``request`` is the stream's request as the router tokenized it (tenant, model,
prompt token ids, sampling, limits and stop rules: the worker request without its
random id), so a ticket resumes only the same request of the same tenant, after
exactly the tokens it was issued for, for TICKET_TTL_S. ``key`` is derived from the
deployment's KV secret, the one every router already holds for the tenants'
prefix-cache salts (router/core/auth.py); a tenant never has it. (The workers hold
that secret too, for their KV connections: a worker in the wrong hands could make
tickets, but it already reads every prompt it serves.) The resuming router charges
and audits the resumed tokens as what they are: prompt it computed."""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Callable, Iterable

from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.v1 import worker_pb2 as wpb

VERSION = 1
TICKET_TTL_S = 900.0
"""How long after the message that carried it a ticket resumes its stream."""
CLOCK_SKEW_S = 60.0
"""How far in the future (another router's clock) a ticket's issue time may be."""
_HEAD = struct.Struct(">BQ")
TICKET_BYTES = _HEAD.size + hashlib.sha256().digest_size
_LABEL = b"kvrelay resume ticket key\0"


def _ids(ids: list[int]) -> bytes:
    return struct.pack(f">{len(ids)}i", *ids)


class TicketStream:
    """The tickets of one stream, one per message with tokens (the running hash of its tokens)."""

    __slots__ = ("_clock", "_count", "_key", "_request", "_tokens")

    def __init__(self, key: bytes, request: bytes, clock: Callable[[], float]) -> None:
        self._key, self._request, self._clock = key, request, clock
        self._tokens = hashlib.sha256()
        self._count = 0

    def after(self, ids: Iterable[int]) -> bytes:
        """The ticket for the stream once the client has ``ids`` too."""
        ids = list(ids)
        self._tokens.update(_ids(ids))
        self._count += len(ids)
        return _ticket(self._key, self._request, self._tokens.digest(), self._count, int(self._clock()))


def _ticket(key: bytes, request: bytes, tokens: bytes, count: int, issued: int) -> bytes:
    head = _HEAD.pack(VERSION, issued)
    return head + hmac.new(key, request + tokens + struct.pack(">IQ", count, issued), hashlib.sha256).digest()


class ResumeTickets:
    """Issues and checks resume tickets under one deployment-wide key (module docstring)."""

    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        """``secret``: the deployment's KV secret (the tickets' key is derived from it)."""
        self._key = hmac.new(secret, _LABEL, hashlib.sha256).digest()
        self._clock = clock

    @staticmethod
    def bind(tenant: str, model: str, work: wpb.WorkRequest) -> bytes:
        """What a stream's tickets are bound to: ``work`` as first tokenized, less its per-router random id."""
        bound = wpb.WorkRequest()
        bound.CopyFrom(work)
        bound.request_id = ""
        body = bound.SerializeToString(deterministic=True)
        return hashlib.sha256(b"\0".join((tenant.encode(), model.encode(), body))).digest()

    def stream(self, binding: bytes, resumed: list[int]) -> TicketStream:
        """The tickets of the stream ``binding`` names, which begins after ``resumed`` (a resumption's tokens)."""
        out = TicketStream(self._key, binding, self._clock)
        if resumed:
            out.after(resumed)
        return out

    def check(self, binding: bytes, resumed: list[int], ticket: bytes, tenant: str) -> None:
        """RouterError PERMISSION_DENIED unless ``ticket`` was issued, within TICKET_TTL_S, by a router of this
        deployment for the stream ``binding`` names (``tenant``'s) after exactly ``resumed``."""
        if len(ticket) != TICKET_BYTES:
            raise RouterError(ErrorKind.PERMISSION_DENIED, (
                "resume_token_ids need the resume_ticket of the last message received (the stream's own "
                f"proof, {TICKET_BYTES} bytes)" if not ticket else
                f"resume_ticket is {len(ticket)} bytes, not the {TICKET_BYTES} of a ticket a router issued"))
        version, issued = _HEAD.unpack_from(ticket)
        want = _ticket(self._key, binding, hashlib.sha256(_ids(resumed)).digest(), len(resumed), issued)
        if version != VERSION or not hmac.compare_digest(ticket, want):
            raise RouterError(ErrorKind.PERMISSION_DENIED,
                              f"resume_ticket does not match: it was not issued to tenant {tenant!r} for this request "
                              f"after these {len(resumed)} resume_token_ids; resume with the request, tokens and "
                              "ticket the stream gave, or send the request afresh")
        age = self._clock() - issued
        if age > TICKET_TTL_S or age < -CLOCK_SKEW_S:
            raise RouterError(ErrorKind.PERMISSION_DENIED,
                              f"resume_ticket was issued {age:.0f} s ago; a stream resumes within "
                              f"{TICKET_TTL_S:.0f} s of its last message: send the request afresh")
