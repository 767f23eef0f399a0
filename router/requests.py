"""Turning a client's GenerateRequest into a validated, tokenized
WorkRequest. Every check here raises :class:`RequestError` with the gRPC
status code to answer and a message naming the problem."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, check_request_length
from engine.tokenizer import Tokenizer
from runtime.convert import sampling_params

MAX_REQUEST_ID_CHARS = 128
MAX_MESSAGES = 256


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class ModelLimits:
    name: str
    max_model_len: int
    vocab_size: int


def tokenize(req: ipb.GenerateRequest, tok: Tokenizer) -> list[int]:
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("no input: set one of prompt, messages or token_ids")
    if which == "prompt":
        if not req.prompt.strip():
            raise InvalidRequestError("prompt is empty")
        if tok.has_chat_template and not req.raw_prompt:
            return tok.encode_chat([{"role": "user", "content": req.prompt}])
        return tok.encode(req.prompt)
    if which == "messages":
        msgs = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        if not msgs:
            raise InvalidRequestError("messages is empty")
        if len(msgs) > MAX_MESSAGES:
            raise InvalidRequestError(f"at most {MAX_MESSAGES} messages are allowed")
        return tok.encode_chat(msgs)
    return list(req.token_ids.ids)


def build_work_request(req: ipb.GenerateRequest, tok: Tokenizer, limits: ModelLimits,
                       salt: str = "") -> tuple[wpb.WorkRequest, SamplingParams]:
    if req.model and req.model != limits.name:
        raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown model {req.model!r}; this cluster serves "
                                                      f"{limits.name!r}")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    try:
        if req.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {req.max_tokens}")
        params = sampling_params(req.sampling, req.max_tokens, list(req.stop), list(req.stop_token_ids),
                                 req.ignore_eos)
        ids = tokenize(req, tok)
        check_request_length(len(ids), params.max_tokens, limits.max_model_len)
        if any(not 0 <= t < limits.vocab_size for t in ids):
            raise InvalidRequestError(f"token ids must be in [0, {limits.vocab_size})")
    except InvalidRequestError as exc:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    rid = req.request_id or uuid.uuid4().hex
    wr = wpb.WorkRequest(request_id=f"{rid}-{uuid.uuid4().hex[:8]}", prompt_token_ids=ids,
                         sampling=req.sampling, max_tokens=params.max_tokens, stop=req.stop,
                         stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, salt=salt)
    return wr, params
