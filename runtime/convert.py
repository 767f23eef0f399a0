"""Conversions between protobuf messages and engine types, shared by the
router and the workers so both read a request the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

if TYPE_CHECKING:  # annotations only: the router imports this module and needs no torch
    from kvrelay.engine.llm_engine import RequestOutput
    from kvrelay.engine.sampler import TopLogprobs

DEFAULT_MAX_TOKENS = 128

_FINISH = {"stop": ipb.FINISH_REASON_STOP, "length": ipb.FINISH_REASON_LENGTH, "abort": ipb.FINISH_REASON_ABORT}


def sampling_params(sampling: ipb.SamplingParams, max_tokens: int, stop: list[str], stop_token_ids: list[int],
                    ignore_eos: bool, prior_output_tokens: int = 0) -> SamplingParams:
    """Validated engine parameters (raises InvalidRequestError)."""
    return SamplingParams(
        max_tokens=max_tokens if max_tokens else DEFAULT_MAX_TOKENS,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p) if sampling.top_p else 1.0,
        top_k=int(sampling.top_k),
        seed=int(sampling.seed) if sampling.HasField("seed") else None,
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        repetition_penalty=float(sampling.repetition_penalty) if sampling.HasField("repetition_penalty") else 1.0,
        presence_penalty=float(sampling.presence_penalty), frequency_penalty=float(sampling.frequency_penalty),
        min_p=float(sampling.min_p), min_tokens=int(sampling.min_tokens), prior_output_tokens=prior_output_tokens,
        logprobs=sampling.logprobs, top_logprobs=int(sampling.top_logprobs))


def request_params(req: ipb.GenerateRequest, max_tokens: int) -> SamplingParams:
    """A client's request as engine parameters, with the rules only the whole request can
    check (``min_tokens`` at most ``max_tokens``); raises InvalidRequestError."""
    params = sampling_params(req.sampling, max_tokens, list(req.stop), list(req.stop_token_ids), req.ignore_eos)
    if params.min_tokens > params.max_tokens:
        raise InvalidRequestError(f"min_tokens ({params.min_tokens}) must be at most max_tokens ({params.max_tokens})")
    return params


def work_params(wr: wpb.WorkRequest, max_tokens: int | None = None) -> SamplingParams:
    """What a worker runs: ``max_tokens`` overrides the request's (a prefill worker samples one
    token; ``min_tokens`` still holds for it)."""
    return sampling_params(wr.sampling, max_tokens or wr.max_tokens, list(wr.stop), list(wr.stop_token_ids),
                           wr.ignore_eos, wr.prior_output_tokens)


def output_to_proto(out: RequestOutput) -> ipb.GenerateResponse:
    msg = ipb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text,
                               logprobs=out.new_logprobs,
                               top_logprobs=[top_logprobs_proto(t) for t in out.new_top_logprobs])
    if out.finished:
        msg.finish.reason = _FINISH.get(out.finish_reason or "", ipb.FINISH_REASON_UNSPECIFIED)
        msg.finish.usage.prompt_tokens = out.num_prompt_tokens
        msg.finish.usage.cached_prompt_tokens = out.num_cached_tokens
    return msg


def top_logprobs_proto(top: TopLogprobs | None) -> ipb.TopLogprobs:
    """The wire form of one position's alternatives (None: an empty one)."""
    if top is None:
        return ipb.TopLogprobs()
    return ipb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)
