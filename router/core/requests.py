"""A client's request as the router core takes it: who is calling
(:class:`Caller`), and the request validated and tokenized
(:class:`Request`). Every check raises :class:`RouterError` with a message
naming the problem."""

from __future__ import annotations

import enum
import secrets
import time
import uuid
from dataclasses import dataclass, field

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.sampling_params import check_request_length
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.runtime.convert import request_params
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

MAX_REQUEST_ID_CHARS = 128
MAX_MESSAGES = 256
MAX_JURISDICTIONS = 64
ROLES = ("system", "user", "assistant")
"""Chat roles the model's template takes; any other is refused (tool calling is not implemented)."""


class Priority(enum.Enum):
    """Who goes first when capacity is short."""

    INTERACTIVE = enum.auto()
    """A client waiting for its answer."""
    BATCH = enum.auto()
    """A batch job's request: starts only while no interactive request waits for room."""


@dataclass(slots=True, frozen=True)
class Caller:
    """Who a request comes from, as a front end established it."""

    tenant: str = ""
    """The tenant its credentials name ("" when no client credentials are configured)."""
    deadline: float | None = None
    """``time.monotonic()`` by which it must be done; None = no deadline."""
    priority: Priority = Priority.INTERACTIVE
    api: str = "grpc"
    """Which front end it came through: grpc, http or jobs (for the audit log)."""
    credential: str = ""
    """What it signed in with: "token", "certificate <identity>" or "anonymous" (for the audit log)."""
    traceparent: str = ""
    """The W3C traceparent the client sent (its span becomes the parent of the request's trace); "" = none."""

    @classmethod
    def with_timeout(cls, tenant: str, timeout_s: float | None, priority: Priority = Priority.INTERACTIVE,
                     api: str = "grpc", credential: str = "", traceparent: str = "") -> Caller:
        """A caller whose deadline is ``timeout_s`` from now (None: none)."""
        return cls(tenant, None if timeout_s is None else time.monotonic() + timeout_s, priority, api, credential,
                   traceparent[:128])

    def time_remaining(self) -> float | None:
        """Seconds to the deadline (never negative); None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


@dataclass(slots=True, frozen=True)
class ModelLimits:
    """What the served model accepts."""

    name: str
    """The name clients use."""
    max_model_len: int
    """Prompt plus completion tokens, at most."""
    vocab_size: int
    chat: bool = False
    """The tokenizer has a chat template."""


@dataclass(slots=True)
class Request:
    """A validated, tokenized request."""

    client_id: str
    """The id the client sees in every response (its own, or one made up)."""
    work: wpb.WorkRequest
    """What the workers get (token ids, sampling, a unique id, the tenant's cache salt)."""
    allowed_jurisdictions: frozenset[str] | None
    """Where it may be processed; None = anywhere."""
    requested_jurisdictions: frozenset[str] | None = None
    """What the request itself asked for, before the tenant's policy narrowed it."""
    chat: bool = False
    """It came as chat messages (else a prompt or token ids)."""
    arrived: float = 0.0
    """``time.perf_counter()`` when the router took it (before tokenizing); 0 = unknown."""
    tokenized_s: float = 0.0
    """Seconds spent validating and tokenizing it."""
    block_hashes: list[int] | None = None
    """The prompt's block hashes in its tenant's domain (computed with the
    tokens, off the event loop); None = not computed."""
    resume: list[int] = field(default_factory=list)
    """Output the client already has (``resume_token_ids``): the first attempt continues after it."""
    binding: bytes = b""
    """What its stream's resume tickets are bound to (router/core/resume.py): tenant, model, request."""


def prompt_bytes(req: ipb.GenerateRequest) -> int:
    """UTF-8 bytes of the prompt's text (a prompt, or the messages' roles and contents); 0 for token ids."""
    which = req.WhichOneof("input")
    if which == "prompt":
        return len(req.prompt.encode("utf-8", "surrogatepass"))
    if which == "messages":
        return sum(len(m.role.encode("utf-8", "surrogatepass")) + len(m.content.encode("utf-8", "surrogatepass"))
                   for m in req.messages.messages)
    return 0


def check_prompt_bytes(req: ipb.GenerateRequest, limit: int) -> None:
    """Refuses a prompt over ``limit`` bytes before anything tokenizes it (RouterError INVALID)."""
    size = prompt_bytes(req)
    if size > limit:
        raise RouterError(ErrorKind.INVALID, f"the prompt is {size} bytes; at most {limit} are accepted "
                                             "(router.api.max_prompt_bytes)")


def tokenize(req: ipb.GenerateRequest, tok: Tokenizer) -> list[int]:
    """The prompt's token ids (a prompt through the chat template unless raw, messages, or ids)."""
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("no input: set one of prompt, messages or token_ids")
    if which == "prompt":
        if not req.prompt.strip():
            raise InvalidRequestError("prompt is empty")
        return tok.encode_prompt(req.prompt, raw=req.raw_prompt)
    if which == "messages":
        msgs = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        if not msgs:
            raise InvalidRequestError("messages is empty")
        if len(msgs) > MAX_MESSAGES:
            raise InvalidRequestError(f"at most {MAX_MESSAGES} messages are allowed")
        for i, m in enumerate(msgs):
            if m["role"] not in ROLES:
                raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got "
                                          f"{m['role'][:40]!r}")
        return tok.encode_chat(msgs)
    return list(req.token_ids.ids)


def _work_request(req: ipb.GenerateRequest, tok: Tokenizer, limits: ModelLimits, salt: str) -> wpb.WorkRequest:
    if req.HasField("max_tokens") and req.max_tokens < 1:  # absent: the default; 0 is refused, as over HTTP
        raise InvalidRequestError(f"max_tokens must be >= 1, got {req.max_tokens}")
    params = request_params(req, req.max_tokens)
    ids = tokenize(req, tok)
    check_request_length(len(ids), params.max_tokens, limits.max_model_len)
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise InvalidRequestError(f"token ids must be in [0, {limits.vocab_size})")
    rid = req.request_id or uuid.uuid4().hex
    # the workers' request id is also the KV transfer's: 128 random bits nobody can guess
    return wpb.WorkRequest(request_id=f"{rid}-{secrets.token_hex(16)}", prompt_token_ids=ids, sampling=req.sampling,
                           max_tokens=params.max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                           ignore_eos=req.ignore_eos, salt=salt)


def parse_request(req: ipb.GenerateRequest, tok: Tokenizer, limits: ModelLimits, salt: str = "",
                  max_prompt_bytes: int | None = None) -> Request:
    """Validates and tokenizes ``req``; ``salt`` is the tenant's prefix-cache domain;
    a prompt over ``max_prompt_bytes`` is refused before tokenizing."""
    if max_prompt_bytes is not None:
        check_prompt_bytes(req, max_prompt_bytes)
    if req.model and req.model != limits.name:
        raise RouterError(ErrorKind.UNKNOWN_MODEL, f"unknown model {req.model[:80]!r}; this cluster serves "
                                                   f"{limits.name!r}")
    if len(req.allowed_jurisdictions) > MAX_JURISDICTIONS:
        raise RouterError(ErrorKind.INVALID, f"at most {MAX_JURISDICTIONS} allowed_jurisdictions, got "
                                             f"{len(req.allowed_jurisdictions)}")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise RouterError(ErrorKind.INVALID, f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    try:
        wr = _work_request(req, tok, limits, salt)
    except InvalidRequestError as exc:
        raise RouterError(ErrorKind.INVALID, str(exc)) from None
    allowed = frozenset(req.allowed_jurisdictions) if req.allowed_jurisdictions else None
    out = Request(req.request_id or wr.request_id, wr, allowed, allowed)
    out.resume = _resumed(req, wr, limits)
    return out


def _resumed(req: ipb.GenerateRequest, wr: wpb.WorkRequest, limits: ModelLimits) -> list[int]:
    """``resume_token_ids`` checked: token ids of this model, fewer than max_tokens."""
    ids = list(req.resume_token_ids)
    if len(ids) >= wr.max_tokens:
        raise RouterError(ErrorKind.INVALID, f"resume_token_ids holds {len(ids)} tokens: max_tokens ({wr.max_tokens}) "
                                             "counts them, so nothing would be left to generate")
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise RouterError(ErrorKind.INVALID, f"resume_token_ids must be in [0, {limits.vocab_size})")
    return ids
