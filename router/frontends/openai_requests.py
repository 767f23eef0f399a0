"""OpenAI request bodies as the router's ``GenerateRequest``: JSON decoding
where every failure (bad syntax, bad UTF-8, lone surrogates, nesting past
the recursion limit, integers past Python's digit limit) is a 400, the
fields of router/frontends/openai_schema.py and nothing else, and each value checked
with a message naming the field. :class:`ApiError` is OpenAI's error shape."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.responses import JSONResponse

from kvrelay.engine.sampling_params import MAX_MIN_TOKENS, RANGES
from kvrelay.router.core.requests import ROLES
from kvrelay.router.frontends.openai_schema import (
    CHAT,
    COMPLETION,
    EXTENSION_FIELDS,
    MAX_COMPLETION_LOGPROBS,
    MAX_TOP_LOGPROBS,
    MESSAGE_FIELDS,
    STREAM_OPTION_FIELDS,
    TEXT_PART_FIELDS,
    refuse_unknown,
)
from kvrelay.v1 import inference_pb2 as ipb

SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate (paired, or lone: the kind that is not valid Unicode)."""


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


def decode_body(raw: bytes) -> dict:
    """The JSON object in ``raw``; ApiError(400) for anything else."""
    try:
        body = json.loads(raw)
        # a lone surrogate escape ("\ud800") decodes to a str no UTF-8 encoder takes:
        # refuse it here rather than wherever the text goes next (the whole check only
        # when the body has such an escape at all: a scan costs a tenth of it)
        if SURROGATE_ESCAPE.search(raw):
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "request body has a string with a lone surrogate escape (such as \\ud800): not valid "
                            "Unicode") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past the digit limit
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _get(body: dict, name: str, types: tuple, what: str, default=None, where: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise ApiError(400, f"'{where}{name}' must be {what}, got {json.dumps(value)[:80]}", param=where + name)
    return value


def _refuse_unknown(obj: dict, allowed, where: str = "") -> None:
    refused = refuse_unknown(obj, allowed, where)
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])


def _text_content(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (images etc. are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            _refuse_unknown(part, TEXT_PART_FIELDS, f"messages[{i}].content[].")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a non-empty list of text parts",
                   param=f"messages[{i}].content")


def _max_tokens(body: dict, req: ipb.GenerateRequest) -> None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _get(body, name, (int,), "an integer")
    other = _get(body, "max_tokens", (int,), "an integer")
    if name == "max_completion_tokens" and other is not None and other != value:
        raise ApiError(400, f"max_tokens ({other}) and max_completion_tokens ({value}) disagree; send one",
                       param="max_tokens")
    if value is not None:
        if value < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {value}", param=name)
        req.max_tokens = min(value, 1 << 30)


def _sampling(body: dict, req: ipb.GenerateRequest) -> None:
    temperature = _get(body, "temperature", (int, float), "a number")
    if temperature is not None:
        if not 0 <= temperature <= 100:  # NaN fails this too
            raise ApiError(400, f"temperature must be in [0, 100], got {temperature}", param="temperature")
        req.sampling.temperature = temperature
    top_p = _get(body, "top_p", (int, float), "a number")
    if top_p is not None:
        if not 0 < top_p <= 1:  # our 0 means "unset"; OpenAI's 0 is invalid as well
            raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
        req.sampling.top_p = top_p
    top_k = _get(body, "top_k", (int,), "an integer")
    if top_k is not None:
        if not -1 <= top_k < 1 << 31:
            raise ApiError(400, f"top_k must be -1, 0 (off) or a positive integer, got {top_k}", param="top_k")
        req.sampling.top_k = max(0, top_k)
    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None:
        if not 0 <= seed < 1 << 63:
            raise ApiError(400, f"seed must be in [0, 2^63), got {seed}", param="seed")
        req.sampling.seed = seed


def _penalties(body: dict, req: ipb.GenerateRequest) -> None:
    """vLLM's and OpenAI's penalties, min_p and min_tokens (engine/sampling_params.py)."""
    rp = _get(body, "repetition_penalty", (int, float), "a number")
    if rp is not None:
        if not 0 < rp <= 2:
            raise ApiError(400, f"repetition_penalty must be in (0, 2], got {rp}", param="repetition_penalty")
        req.sampling.repetition_penalty = rp
    for name, (low, high) in RANGES.items():
        value = _get(body, name, (int, float), "a number")
        if value is not None:
            if not low <= value <= high:
                raise ApiError(400, f"{name} must be in [{low:g}, {high:g}], got {value}", param=name)
            setattr(req.sampling, name, value)
    min_tokens = _get(body, "min_tokens", (int,), "an integer")
    if min_tokens is not None:
        if not 0 <= min_tokens <= MAX_MIN_TOKENS:
            raise ApiError(400, f"min_tokens must be in [0, {MAX_MIN_TOKENS}], got {min_tokens}", param="min_tokens")
        if req.HasField("max_tokens") and min_tokens > req.max_tokens:
            raise ApiError(400, f"min_tokens ({min_tokens}) must be at most max_tokens ({req.max_tokens})",
                           param="min_tokens")
        req.sampling.min_tokens = min_tokens


def _stop(body: dict, req: ipb.GenerateRequest) -> None:
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop.extend(stop)
    elif stop is not None:
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    ids = _get(body, "stop_token_ids", (list,), "a list of token ids", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in ids):
        raise ApiError(400, "'stop_token_ids' must be a list of non-negative 32-bit integers", param="stop_token_ids")
    req.stop_token_ids.extend(ids)  # their count: the core checks it, as over gRPC


def _extension(body: dict, req: ipb.GenerateRequest) -> None:
    ext = _get(body, "kvrelay", (dict,), "an object", {})
    _refuse_unknown(ext, EXTENSION_FIELDS, "kvrelay.")
    allowed = _get(ext, "allowed_jurisdictions", (list,), "a list of strings", [], "kvrelay.")
    if not all(isinstance(j, str) for j in allowed):
        raise ApiError(400, "'kvrelay.allowed_jurisdictions' must be a list of strings",
                       param="kvrelay.allowed_jurisdictions")
    req.allowed_jurisdictions.extend(allowed)
    req.request_id = _get(ext, "request_id", (str,), "a string", "", "kvrelay.")
    # top-level ignore_eos: vLLM's extension, which benchmark clients send to force output lengths
    req.ignore_eos = _get(ext, "ignore_eos", (bool,), "a boolean", False, "kvrelay.") or \
        _get(body, "ignore_eos", (bool,), "a boolean", False)


def _common(body: dict, req: ipb.GenerateRequest) -> tuple[bool, bool]:
    """Fields both endpoints share; returns (stream, include_usage)."""
    req.model = _get(body, "model", (str,), "a string", "")
    _max_tokens(body, req)
    _sampling(body, req)
    _penalties(body, req)
    _stop(body, req)
    n = _get(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {n}", param="n")
    stream = _get(body, "stream", (bool,), "a boolean", False)
    options = _get(body, "stream_options", (dict,), "an object", {})
    if options and not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    _refuse_unknown(options, STREAM_OPTION_FIELDS, "stream_options.")
    include_usage = _get(options, "include_usage", (bool,), "a boolean", False, "stream_options.")
    _extension(body, req)
    return stream, include_usage


def chat_request(body: dict) -> tuple[ipb.GenerateRequest, bool, bool]:
    """A /v1/chat/completions body as a GenerateRequest (plus stream, include_usage)."""
    _refuse_unknown(body, CHAT["properties"])
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    req = ipb.GenerateRequest()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        _refuse_unknown(m, MESSAGE_FIELDS, f"messages[{i}].")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ROLES:  # the core refuses it too (gRPC); here the error can name its param
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role[:40]!r}",
                           param=f"messages[{i}].role")
        req.messages.messages.add(role=role, content=_text_content(m.get("content"), i))
    if _get(body, "logprobs", (bool,), "a boolean", False):
        req.sampling.logprobs = True
    top = _get(body, "top_logprobs", (int,), "an integer")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
        if not req.sampling.logprobs and top > 0:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        req.sampling.top_logprobs = top
    return (req, *_common(body, req))


def _prompt(body: dict, req: ipb.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt, req.raw_prompt = prompt, True
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < 1 << 31 for t in prompt):
            raise ApiError(400, "token ids in 'prompt' must be non-negative 32-bit integers", param="prompt")
        req.token_ids.ids.extend(prompt)
    else:
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of one of those "
                            "(one prompt per request)", param="prompt")


def completion_request(body: dict) -> tuple[ipb.GenerateRequest, bool, bool]:
    """A /v1/completions body: raw text (no chat template) or token ids."""
    _refuse_unknown(body, COMPLETION["properties"])
    req = ipb.GenerateRequest()
    _prompt(body, req)
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "'best_of' must be 1", param="best_of")
    top = _get(body, "logprobs", (int,), f"an integer in [0, {MAX_COMPLETION_LOGPROBS}]")
    if top is not None:
        if not 0 <= top <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {top}", param="logprobs")
        req.sampling.logprobs, req.sampling.top_logprobs = True, top
    return (req, *_common(body, req))
