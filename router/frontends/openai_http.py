"""OpenAI-compatible HTTP API of the router: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.

Starlette on uvicorn, in the router's own event loop: a request becomes the
same ``GenerateRequest`` a gRPC client would send and runs through the
router core (router/core/pipeline.py), so validation, admission, placement and
recovery have one implementation; each :class:`~kvrelay.router.core.errors.ErrorKind`
maps to an HTTP status and OpenAI's error shape (:data:`HTTP_STATUS`).

Streaming uses server-sent events ending in ``data: [DONE]``; with
``stream_options.include_usage`` a last chunk carries ``usage``. kvrelay's
own fields travel in an extension object ``kvrelay``: in a request,
``{"allowed_jurisdictions": [...], "request_id": "...", "ignore_eos": bool}``
(``ignore_eos`` is also accepted at the top level, as vLLM does);
in a response (and the last stream chunk), ``{"placement": {...},
"cached_prompt_tokens": N}``. Standard clients ignore it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from importlib.metadata import version
from typing import Any

from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvrelay.engine.blocks import ceil_div
from kvrelay.router.core.auth import CallerAuth
from kvrelay.router.core.errors import ErrorKind, RouterError
from kvrelay.router.core.pipeline import RouterCore
from kvrelay.router.core.requests import Caller
from kvrelay.router.frontends.logprobs import openai_logprobs
from kvrelay.router.frontends.openai_requests import (
    ApiError,
    chat_request,
    completion_request,
    decode_body,
)
from kvrelay.router.frontends.openai_schema import openapi
from kvrelay.runtime.config import HttpSection
from kvrelay.runtime.pki import Identity
from kvrelay.runtime.tls import PeerRefused, TLSMaterial
from kvrelay.runtime.tracing import TRACEPARENT
from kvrelay.v1 import inference_pb2 as ipb

log = logging.getLogger(__name__)

HTTP_STATUS = {
    ErrorKind.INVALID: (400, "invalid_request_error"),
    ErrorKind.CONSTRAINT: (400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.PERMISSION_DENIED: (403, "permission_error"),
    ErrorKind.ALREADY_EXISTS: (409, "conflict_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.UNKNOWN_MODEL: (404, "not_found_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.CANCELLED: (499, "cancelled"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.DEADLINE: (504, "timeout"),
    ErrorKind.INTERNAL: (500, "server_error"),
}
"""Error kind of the shared request path -> HTTP status and OpenAI error type."""

FINISH = {ipb.FINISH_REASON_STOP: "stop", ipb.FINISH_REASON_LENGTH: "length", ipb.FINISH_REASON_ABORT: "stop"}
CLOSE = {"Connection": "close"}
"""On an answer to a client too slow to finish its body: no lingering (router/frontends/http_server.py)."""


def api_error(exc: RouterError) -> ApiError:
    """A router error in OpenAI's shape (``code`` is the kind, e.g. model_not_found)."""
    status, type_ = HTTP_STATUS[exc.kind]
    headers = {}
    if status == 429 and exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, ceil_div(int(exc.retry_after_s * 1e3), 1000)))  # whole seconds, up
    return ApiError(status, exc.message, type_, code=exc.kind.value, headers=headers)


# -- responses ---------------------------------------------------------------------------------------------------
def _usage(finish: ipb.Finish) -> dict:
    u = finish.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def _extension(finish: ipb.Finish) -> dict:
    p = finish.placement
    return {"placement": {f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields},
            "cached_prompt_tokens": finish.usage.cached_prompt_tokens}


class OpenAIServer:
    """The HTTP API over the router core."""

    def __init__(self, core: RouterCore, limits: HttpSection, request_timeout_s: float | None = None,
                 tls: TLSMaterial | None = None, auth: CallerAuth | None = None) -> None:
        """``tls``: the router's material, whose CA and revoked serials a client certificate is checked by;
        ``auth``: who callers are (the gRPC front ends', so one OpenID key cache serves both; default: its own)."""
        self.core, self.tls = core, tls
        self.limits = limits
        self.model_name = core.limits.name
        """The name answers carry when the request names none."""
        self.auth = auth or CallerAuth(core.cfg)
        self.request_timeout_s = request_timeout_s
        self.schema = openapi(version("kvrelay"))
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._bad_method})

    async def _not_found(self, request: Request, exc) -> JSONResponse:
        return ApiError(404, f"no such endpoint: {request.method} {request.url.path}", "not_found_error").response()

    async def _bad_method(self, request: Request, exc) -> JSONResponse:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def openapi(self, request: Request) -> JSONResponse:
        """The accepted request schema (no credentials needed: it is the same for everyone)."""
        return JSONResponse(self.schema)

    def cert(self, request: Request) -> Identity | None:
        """The identity of the client certificate the caller presented over TLS (None: none);
        RouterError(UNAUTHENTICATED) when it is revoked or names no kvrelay identity."""
        chain = request.scope.get("extensions", {}).get("tls", {}).get("client_cert_chain")
        if not chain or self.tls is None:
            return None
        try:
            return self.tls.peer_of_pem(chain[0].encode())
        except PeerRefused as exc:
            raise RouterError(ErrorKind.UNAUTHENTICATED, exc.message) from None

    async def models(self, request: Request) -> JSONResponse:
        try:
            how = request.headers.get("authorization", "")
            await self.auth.ready(how)
            self.auth.tenant(how, self.cert(request))
        except RouterError as exc:
            return api_error(exc).response()
        lim = self.core.limits
        return JSONResponse({"object": "list", "data": [{
            "id": lim.name, "object": "model", "created": 0, "owned_by": "kvrelay",
            "context_window": lim.max_model_len}]})

    async def health(self, request: Request) -> JSONResponse:
        h = self.core.health()
        body = MessageToDict(h, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        return JSONResponse(body, status_code=200 if h.serving else 503)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _body(self, request: Request) -> bytes:
        """The body, read as it arrives: 413 past the cap (declared or not), 408 past the deadline."""
        cap, declared = self.limits.max_body_bytes, request.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > cap):  # refused before reading it
            raise ApiError(413, f"request body over {cap} bytes (declared {declared[:20]})")
        raw = bytearray()
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > cap:
                        raise ApiError(413, f"request body over {cap} bytes")
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                           "timeout", headers=CLOSE) from None
        except ClientDisconnect:
            raise ApiError(499, "the client went away before sending the whole body", "cancelled") from None
        return bytes(raw)

    async def _request(self, request: Request, chat: bool) -> tuple[ipb.GenerateRequest, bool, bool, Caller]:
        """Who calls (before anything of the body is read), then what they ask."""
        how = request.headers.get("authorization", "")
        try:
            cert = self.cert(request)
            await self.auth.ready(how)
            tenant = self.auth.tenant(how, cert)
        except RouterError as exc:
            self.core.audit_refused("http", exc, "certificate" if request.scope.get("extensions", {}).get("tls")
                                    else "token" if how else "none")
            raise api_error(exc) from None
        try:
            self.core.door(tenant, "http")  # before the body: a prompt that may not enter here is never read
        except RouterError as exc:
            raise api_error(exc) from None
        body = decode_body(await self._body(request))
        req, stream, include_usage = chat_request(body) if chat else completion_request(body)
        return req, stream, include_usage, Caller.with_timeout(
            tenant, self.request_timeout_s, api="http", credential=self.auth.credential(how, cert),
            traceparent=request.headers.get(TRACEPARENT, ""))

    async def _first(self, req: ipb.GenerateRequest, caller: Caller):
        """Admission up to the first message: (the core's generator, that message), or the error's response."""
        try:  # the first message, or the error, decides the HTTP status
            gen = self.core.generate(await self.core.admit(req, caller), caller, req)
            return gen, await gen.__anext__()
        except RouterError as exc:
            return api_error(exc).response()
        except StopAsyncIteration:
            return ApiError(500, "the request ended without a result", "server_error").response()

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            req, stream, include_usage, caller = await self._request(request, chat)
        except ApiError as exc:
            return exc.response()
        started = await until_disconnect(request, self._first(req, caller))  # a client gone while queued: stop
        if isinstance(started, Response):
            return started
        gen, first = started
        rid = ("chatcmpl-" if chat else "cmpl-") + (req.request_id or uuid.uuid4().hex)
        model = req.model or self.model_name
        if stream:
            return ClosingStream(self._sse(gen, first, rid, model, chat, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await until_disconnect(request, self._whole(gen, first, rid, model, chat))

    async def _messages(self, gen, first):
        yield first
        async for msg in gen:
            yield msg

    async def _whole(self, gen, first, rid: str, model: str, chat: bool) -> JSONResponse:
        text, ids, lps, tops, finish = [], [], [], [], None
        try:
            async for msg in self._messages(gen, first):
                text.append(msg.text)
                ids.extend(msg.token_ids)
                lps.extend(msg.logprobs)
                tops.extend(msg.top_logprobs)
                if msg.HasField("finish"):
                    finish = msg.finish
        except RouterError as exc:
            return api_error(exc).response()
        except asyncio.CancelledError:  # the client went away (until_disconnect): stop the workers now
            await gen.aclose()
            raise
        if finish is None:  # the core's last message carries it
            raise RuntimeError(f"{rid}: the answer ended without its finish")
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH.get(finish.reason, "stop"),
                                  "logprobs": openai_logprobs(self.core.tok, chat, ids, lps, tops)}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": model, "choices": [choice],
                             "usage": _usage(finish), "kvrelay": _extension(finish)})

    async def _sse(self, gen, first, rid: str, model: str, chat: bool, include_usage: bool):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                          "choices": choices, **extra}) + "\n\n"

        sent = 0  # characters of text so far (completions' text_offset)
        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            async for msg in self._messages(gen, first):
                done = msg.HasField("finish")
                if msg.text or msg.token_ids or done:
                    lp = openai_logprobs(self.core.tok, chat, list(msg.token_ids), list(msg.logprobs),
                                         list(msg.top_logprobs), text_offset=sent)
                    sent += len(msg.text)
                    c: dict[str, Any] = {"index": 0, "finish_reason": FINISH.get(msg.finish.reason, "stop") if done
                                         else None, "logprobs": lp}
                    if chat:
                        c["delta"] = {"content": msg.text} if msg.text else {}
                    else:
                        c["text"] = msg.text
                    extra = {"kvrelay": _extension(msg.finish)} if done else {}
                    yield chunk([c], **extra)
                if done and include_usage:
                    yield chunk([], usage=_usage(msg.finish))
        except RouterError as exc:  # after the status line went out: the error is the last event
            yield "data: " + json.dumps(api_error(exc).body()) + "\n\n"
        finally:  # done, or the client went away (ClosingStream closes us): the relay's cleanup frees the workers
            await gen.aclose()
        yield "data: [DONE]\n\n"


class ClosingStream(StreamingResponse):
    """A streaming response that closes its body generator however it ends
    (Starlette leaves it suspended when the client goes away mid-stream)."""

    body_iterator: AsyncGenerator[str, None]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def until_disconnect(request: Request, answer):
    """What ``answer`` (a coroutine) returns, or a 499 response if the client
    goes away first: ``answer`` is then cancelled (which closes the core's
    generator, stopping the workers and freeing their blocks)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(answer), asyncio.ensure_future(gone())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return ApiError(499, "the client went away; the request was cancelled", "cancelled").response()
    return work.result()
