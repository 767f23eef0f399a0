"""What the OpenAI-compatible HTTP API accepts, as JSON Schema, published at
``GET /openapi.json`` (OpenAPI 3.1). The same tables decide which fields a
request may carry: a field not listed here is refused with a 400 naming it
(:func:`refuse_unknown`), so a client never mistakes an ignored field for one
that was honoured. Values are checked by router/frontends/openai_http.py, whose
messages name the field."""

from __future__ import annotations

from typing import Any

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token for chat's ``top_logprobs`` (OpenAI's bound)."""
MAX_COMPLETION_LOGPROBS = 5
"""Most alternatives per token for completions' integer ``logprobs`` (OpenAI's bound)."""

NOT_IMPLEMENTED = {
    "tools": "tool calling is not implemented",
    "tool_choice": "tool calling is not implemented",
    "parallel_tool_calls": "tool calling is not implemented",
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "response_format": "structured output (json_object, json_schema) is not implemented; only {\"type\": \"text\"}",
    "logit_bias": "logit_bias is not implemented",
    "audio": "audio output is not implemented", "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented", "store": "stored completions are not implemented",
    "metadata": "stored completions are not implemented", "user": "end-user ids are not recorded",
    "service_tier": "service tiers are not implemented", "reasoning_effort": "this model does not reason",
    "web_search_options": "web search is not implemented",
}
"""OpenAI fields kvrelay knows and does not implement, with why; any value but the neutral one is refused."""

NEUTRAL: dict[str, tuple[Any, ...]]
NEUTRAL = {"response_format": ({"type": "text"},), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
           "store": (False,)}
"""Values of not-implemented fields that ask for exactly what kvrelay does anyway (accepted: real
clients send them)."""


def is_neutral(name: str, value: Any) -> bool:
    """Whether ``value`` is None or one of ``name``'s neutral values, of the same JSON type
    (``true`` is not ``1``, ``false`` is not ``0``)."""
    return value is None or any(type(value) is type(n) and value == n for n in NEUTRAL.get(name, ()))

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_COUNT = _nullable({**_INT, "minimum": 1})
_STOP = _nullable({"anyOf": [{"type": "string", "maxLength": 256},
                             {"type": "array", "items": {"type": "string", "maxLength": 256}, "maxItems": 16}]})
_EXTENSION: dict[str, Any]
_EXTENSION = {"type": "object", "additionalProperties": False, "properties": {
    "allowed_jurisdictions": {"type": "array", "items": {"type": "string"}, "maxItems": 64,
                              "description": "where the request may be processed (never widens the tenant's)"},
    "request_id": {"type": "string", "maxLength": 128},
    "ignore_eos": _BOOL}}

COMMON: dict[str, dict] = {
    "model": {"type": "string", "description": "the served model's name; empty: the default"},
    "max_tokens": _COUNT, "max_completion_tokens": _COUNT,
    "temperature": _nullable({**_NUM, "minimum": 0, "maximum": 100}),
    "top_p": _nullable({**_NUM, "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable({**_INT, "minimum": -1, "description": "vLLM's extension; 0 or -1: off"}),
    "seed": _nullable({**_INT, "minimum": 0, "maximum": (1 << 63) - 1}),
    "stop": _STOP,
    "n": _nullable({**_INT, "minimum": 1, "maximum": 1}),
    "stream": _nullable(_BOOL),
    "stream_options": _nullable({"type": "object", "additionalProperties": False,
                                 "properties": {"include_usage": _BOOL}}),
    "ignore_eos": _nullable(_BOOL),
    "stop_token_ids": _nullable({"type": "array", "items": {**_INT, "minimum": 0, "maximum": (1 << 31) - 1},
                                 "maxItems": 64, "description": "vLLM's extension: token ids that end the output"}),
    "repetition_penalty": _nullable({**_NUM, "exclusiveMinimum": 0, "maximum": 2, "description":
                                     "vLLM's extension: scales the logits of tokens in the prompt or output; 1: off"}),
    "presence_penalty": _nullable({**_NUM, "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({**_NUM, "minimum": -2, "maximum": 2}),
    "min_p": _nullable({**_NUM, "minimum": 0, "maximum": 1, "description":
                        "vLLM's extension: drop tokens below min_p x the most likely one's probability"}),
    "min_tokens": _nullable({**_INT, "minimum": 0, "description":
                             "vLLM's extension: at least this many tokens before EOS, stop ids or strings"}),
    "kvrelay": _EXTENSION,
    **{name: {"description": f"accepted only as {NEUTRAL[name][0]!r}: {why}"}
       for name, why in NOT_IMPLEMENTED.items() if name in NEUTRAL},
}
"""Fields both endpoints take."""

_TEXT_PART: dict[str, Any]
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_MESSAGE: dict[str, Any]
_MESSAGE = {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART, "minItems": 1}]}}}
MESSAGE_FIELDS = frozenset(_MESSAGE["properties"])
TEXT_PART_FIELDS = frozenset(_TEXT_PART["properties"])
EXTENSION_FIELDS = frozenset(_EXTENSION["properties"])
STREAM_OPTION_FIELDS = frozenset(COMMON["stream_options"]["anyOf"][0]["properties"])
"""The keys each nested object may have (the published schema's, so the two cannot disagree)."""

CHAT: dict[str, Any] = {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": {
    **COMMON,
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 256},
    "logprobs": _nullable(_BOOL),
    "top_logprobs": _nullable({**_INT, "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
}}
"""``POST /v1/chat/completions``."""

_TOKEN_IDS = {"type": "array", "items": {**_INT, "minimum": 0, "maximum": (1 << 31) - 1}, "minItems": 1}
COMPLETION: dict[str, Any] = {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
    **COMMON,
    "prompt": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                         {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
                          "minItems": 1, "maxItems": 1}]},
    "logprobs": _nullable({**_INT, "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS}),
    "echo": _nullable({"const": False}),
    "suffix": _nullable({"const": ""}),
    "best_of": _nullable({**_INT, "minimum": 1, "maximum": 1}),
}}
"""``POST /v1/completions``."""


def refuse_unknown(obj: dict, allowed: frozenset[str] | dict, where: str = "") -> tuple[str, str] | None:
    """(the field's path, the message refusing it) for the first field of ``obj``
    that is not in ``allowed`` (or is a not-implemented one with a non-neutral
    value); None when all are allowed."""
    for name, value in obj.items():
        if name in allowed and (name not in NOT_IMPLEMENTED or is_neutral(name, value)):
            continue
        path = f"{where}{name}"
        if name in NOT_IMPLEMENTED:
            return path, f"'{path}' is not supported: {NOT_IMPLEMENTED[name]}"
        return path, f"unknown field '{path}': kvrelay does not implement it"
    return None


def _error_response(description: str) -> dict:
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    return {"description": description, "content": {"application/json": {"schema": error}}}


ERRORS = {"400": "invalid request (the message names the field)", "401": "no or wrong bearer token",
          "403": "the credentials may not call this", "404": "unknown model", "408": "the body arrived too slowly",
          "413": "the body is over the size limit", "429": "overloaded: retry after Retry-After seconds",
          "499": "the client went away", "503": "no worker can serve now", "504": "the request's deadline passed"}


def _operation(summary: str, schema: dict) -> dict:
    ok = {"description": "the answer (JSON), or server-sent events when stream is true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {"post": {"summary": summary, "security": [{"bearer": []}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": {"200": ok, **{code: _error_response(why) for code, why in ERRORS.items()}}}}


def openapi(version: str) -> dict:
    """The OpenAPI 3.1 document of the API."""
    models = {"get": {"summary": "the served model", "security": [{"bearer": []}], "responses": {
        "200": {"description": "the model list", "content": {"application/json": {"schema": {"type": "object"}}}},
        "401": _error_response("no or wrong bearer token")}}}
    return {"openapi": "3.1.0", "info": {"title": "kvrelay OpenAI-compatible API", "version": version},
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "paths": {"/v1/chat/completions": _operation("a chat completion", CHAT),
                      "/v1/completions": _operation("a text completion", COMPLETION),
                      "/v1/models": models}}
