"""OpenAI-compatible HTTP API of the router: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.

Starlette on uvicorn, in the router's own event loop: a request becomes the
same ``GenerateRequest`` a gRPC client would send and runs through the
router core (router/core.py), so validation, admission, placement and
recovery have one implementation; each :class:`~router.errors.ErrorKind`
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
import json
import logging
import socket
import time
import uuid
from typing import Any

from google.protobuf.json_format import MessageToDict
from kvrelay.v1 import inference_pb2 as ipb
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.blocks import ceil_div
from router.auth import CallerAuth
from router.core import RouterCore
from router.errors import ErrorKind, RouterError
from router.requests import Caller
from runtime.config import is_loopback

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
MAX_BODY_BYTES = 8 << 20
"""Request bodies larger than this are refused (413)."""


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(exc: RouterError) -> ApiError:
    """A router error in OpenAI's shape (``code`` is the kind, e.g. model_not_found)."""
    status, type_ = HTTP_STATUS[exc.kind]
    headers = {}
    if status == 429 and exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, ceil_div(int(exc.retry_after_s * 1e3), 1000)))  # whole seconds, up
    return ApiError(status, exc.message, type_, code=exc.kind.value, headers=headers)


# -- request parsing ---------------------------------------------------------------------------------------------
def _get(body: dict, name: str, types: tuple, what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:80]}", param=name)
    return value


def _text_content(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (images etc. are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def _common(body: dict, req: ipb.GenerateRequest) -> tuple[bool, bool]:
    """Fields both endpoints share; returns (stream, include_usage)."""
    req.model = _get(body, "model", (str,), "a string", "")
    max_tokens = _get(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None:
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        req.max_tokens = min(max_tokens, 1 << 30)
    temperature = _get(body, "temperature", (int, float), "a number")
    if temperature is not None:
        req.sampling.temperature = temperature
    top_p = _get(body, "top_p", (int, float), "a number")
    if top_p is not None:
        if top_p <= 0:  # our 0 means "unset"; OpenAI's 0 is invalid as well
            raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
        req.sampling.top_p = top_p
    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None:
        if not 0 <= seed < 1 << 63:
            raise ApiError(400, f"seed must be in [0, 2^63), got {seed}", param="seed")
        req.sampling.seed = seed
    if _get(body, "logprobs", (bool,), "a boolean", False) is True:
        req.sampling.logprobs = True
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop.extend(stop)
    elif stop is not None:
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    n = _get(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {n}", param="n")
    stream = _get(body, "stream", (bool,), "a boolean", False)
    options = _get(body, "stream_options", (dict,), "an object", {})
    include_usage = _get(options, "include_usage", (bool,), "a boolean", False)
    ext = _get(body, "kvrelay", (dict,), "an object", {})
    allowed = _get(ext, "allowed_jurisdictions", (list,), "a list of strings", [])
    if not all(isinstance(j, str) for j in allowed):
        raise ApiError(400, "'kvrelay.allowed_jurisdictions' must be a list of strings",
                       param="kvrelay.allowed_jurisdictions")
    req.allowed_jurisdictions.extend(allowed)
    req.request_id = _get(ext, "request_id", (str,), "a string", "")
    # top-level ignore_eos: vLLM's extension, which benchmark clients send to force output lengths
    req.ignore_eos = _get(ext, "ignore_eos", (bool,), "a boolean", False) or \
        _get(body, "ignore_eos", (bool,), "a boolean", False)
    return stream, include_usage


def chat_request(body: dict) -> tuple[ipb.GenerateRequest, bool, bool]:
    """A /v1/chat/completions body as a GenerateRequest (plus stream, include_usage)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    req = ipb.GenerateRequest()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        role = "system" if m["role"] == "developer" else m["role"]
        req.messages.messages.add(role=role, content=_text_content(m.get("content"), i))
    return (req, *_common(body, req))


def completion_request(body: dict) -> tuple[ipb.GenerateRequest, bool, bool]:
    """A /v1/completions body: raw text (no chat template) or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    req = ipb.GenerateRequest()
    if isinstance(prompt, str):
        req.prompt, req.raw_prompt = prompt, True
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < 1 << 31 for t in prompt):
            raise ApiError(400, "token ids in 'prompt' must be non-negative 32-bit integers", param="prompt")
        req.token_ids.ids.extend(prompt)
    else:
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of one of those "
                            "(one prompt per request)", param="prompt")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "'best_of' must be 1", param="best_of")
    return (req, *_common(body, req))


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


def _logprobs(chat: bool, token_ids: list[int], logprobs: list[float]) -> dict | None:
    if not logprobs:
        return None
    if chat:
        return {"content": [{"token": f"<{t}>", "logprob": lp, "bytes": None, "top_logprobs": []}
                            for t, lp in zip(token_ids, logprobs)]}
    return {"tokens": [f"<{t}>" for t in token_ids], "token_logprobs": list(logprobs)}


class OpenAIServer:
    """The HTTP API over the router core."""

    def __init__(self, core: RouterCore, request_timeout_s: float | None = None) -> None:
        self.core = core
        self.auth = CallerAuth(core.cfg.auth)
        self.request_timeout_s = request_timeout_s
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._bad_method})

    async def _not_found(self, request: Request, exc) -> JSONResponse:
        return ApiError(404, f"no such endpoint: {request.method} {request.url.path}", "not_found_error").response()

    async def _bad_method(self, request: Request, exc) -> JSONResponse:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def models(self, request: Request) -> JSONResponse:
        try:
            self.auth.tenant(request.headers.get("authorization", ""))
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

    async def _body(self, request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:  # refused before reading it
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await self._body(request)
            req, stream, include_usage = chat_request(body) if chat else completion_request(body)
        except ApiError as exc:
            return exc.response()
        try:  # the first message, or the error, decides the HTTP status
            tenant = self.auth.tenant(request.headers.get("authorization", ""))
            caller = Caller.with_timeout(tenant, self.request_timeout_s)
            gen = self.core.generate(self.core.prepare(req, caller), caller)
            first = await gen.__anext__()
        except RouterError as exc:
            return api_error(exc).response()
        except StopAsyncIteration:
            return ApiError(500, "the request ended without a result", "server_error").response()
        rid = ("chatcmpl-" if chat else "cmpl-") + (req.request_id or uuid.uuid4().hex)
        model = req.model or self.core.limits.name
        if stream:
            return StreamingResponse(self._sse(gen, first, rid, model, chat, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(gen, first, rid, model, chat)

    async def _messages(self, gen, first):
        yield first
        async for msg in gen:
            yield msg

    async def _whole(self, gen, first, rid: str, model: str, chat: bool) -> JSONResponse:
        text, ids, lps, finish = [], [], [], None
        try:
            async for msg in self._messages(gen, first):
                text.append(msg.text)
                ids.extend(msg.token_ids)
                lps.extend(msg.logprobs)
                if msg.HasField("finish"):
                    finish = msg.finish
        except RouterError as exc:
            return api_error(exc).response()
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH.get(finish.reason, "stop"),
                                  "logprobs": _logprobs(chat, ids, lps)}
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

        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            async for msg in self._messages(gen, first):
                done = msg.HasField("finish")
                if msg.text or msg.token_ids or done:
                    c: dict[str, Any] = {"index": 0, "finish_reason": FINISH.get(msg.finish.reason, "stop") if done
                                         else None, "logprobs": _logprobs(chat, list(msg.token_ids),
                                                                          list(msg.logprobs))}
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
        except asyncio.CancelledError:  # the client went away; the relay's cleanup frees the workers
            await gen.aclose()
            raise
        yield "data: [DONE]\n\n"


async def serve_http(app, host: str, port: int, tls_files: tuple[str, str] | None) -> tuple[object, asyncio.Task, int]:
    """Starts uvicorn on ``host:port`` (0: any free port) in this event loop,
    over TLS with ``tls_files`` (certificate and key files), in plaintext
    without (loopback only); returns the server, its task and the bound port."""
    import uvicorn

    if tls_files is None and not is_loopback(host):
        raise OSError(f"refusing to serve HTTP in plaintext on {host}:{port} (not a loopback address)")
    ssl = {"ssl_certfile": tls_files[0], "ssl_keyfile": tls_files[1]} if tls_files else {}
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                           timeout_graceful_shutdown=2, **ssl))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(200):
        if server.started or task.done():
            break
        await asyncio.sleep(0.025)
    if not server.started:
        if task.done() and task.exception() is not None:
            raise RuntimeError(f"HTTP server did not start on {host}:{port}: {task.exception()}")
        raise RuntimeError(f"HTTP server did not start on {host}:{port} within 5 s")
    return server, task, sock.getsockname()[1]
