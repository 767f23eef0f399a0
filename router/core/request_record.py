"""What the audit log says about one request (router/governance/audit.py writes it):
who (tenant, credential, API), what (model, request id, priority,
jurisdictions asked for and in force), where (prefill and decode site and
worker, the link and transport the KV crossed), how much (prompt,
resumed, completion and cached tokens, KV bytes, retries, migrations), how it ended
and when. Never the prompt or output text, unless the tenant's policy says
``log_prompts``."""

from __future__ import annotations

import datetime as dt
import time

from kvrelay.router.core.errors import RouterError
from kvrelay.router.core.requests import Caller, Request
from kvrelay.v1 import inference_pb2 as ipb

FINISH = {ipb.FINISH_REASON_STOP: "stop", ipb.FINISH_REASON_LENGTH: "length"}


def iso(t: float) -> str:
    """``t`` (seconds since the epoch) as ISO-8601 UTC with milliseconds."""
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def prompt_text(msg: ipb.GenerateRequest) -> str:
    """The prompt as the client wrote it (messages as ``role: content`` lines; token ids as numbers)."""
    which = msg.WhichOneof("input")
    if which == "prompt":
        return msg.prompt
    if which == "messages":
        return "\n".join(f"{m.role}: {m.content}" for m in msg.messages.messages)
    return " ".join(map(str, msg.token_ids.ids)) if which == "token_ids" else ""


def _sorted(js: frozenset[str] | None) -> list[str] | None:
    return None if js is None else sorted(js)


class RequestRecord:
    """Collects one request's audit record as its answer streams by."""

    def __init__(self, caller: Caller, model: str, request_id: str, requested: frozenset[str] | None = None,
                 log_text: str | None = None) -> None:
        """``log_text``: the prompt, only when the tenant allows logging it (then the output is kept too)."""
        self.started = time.time()
        self.t0 = time.perf_counter()
        self.ttft_ms: float | None = None
        self.fields: dict = {
            "tenant": caller.tenant, "credential": caller.credential, "api": caller.api, "model": model,
            "request_id": request_id, "priority": caller.priority.name.lower(),
            "jurisdictions_requested": _sorted(requested)}
        self.completion = 0
        self.output: list[str] | None = None if log_text is None else []
        if log_text is not None:
            self.fields["prompt"] = log_text

    def admitted(self, req: Request) -> None:
        """The request passed validation: its size and the jurisdictions in force."""
        self.fields |= {"work_id": req.work.request_id, "prompt_tokens": len(req.work.prompt_token_ids),
                        "max_tokens": req.work.max_tokens, "jurisdictions": _sorted(req.allowed_jurisdictions)}

    def resumed(self, ids: list[int], text: str | None) -> None:
        """It resumes a stream after ``ids`` (prefilled here with its prompt; charged as prompt):
        ``resumed_tokens`` counts them and, for a tenant whose prompts are logged, ``resumed_output``
        holds their ``text`` (the router that streamed them may have died before its record)."""
        self.fields["resumed_tokens"] = len(ids)
        if text is not None and ids:
            self.fields["resumed_output"] = text

    def saw(self, msg: ipb.GenerateResponse) -> None:
        """One message of the answer on its way to the client."""
        if msg.token_ids and self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.t0) * 1e3
        self.completion += len(msg.token_ids)
        if self.output is not None:
            self.output.append(msg.text)
        if msg.HasField("finish"):
            self._finished(msg.finish)

    def _finished(self, f: ipb.Finish) -> None:
        p = f.placement
        self.fields |= {
            "finish_reason": FINISH.get(f.reason, "unspecified"), "cached_tokens": f.usage.cached_prompt_tokens,
            "prefill_site": p.prefill_site, "prefill_worker": p.prefill_worker, "decode_site": p.decode_site,
            "decode_worker": p.decode_worker, "colocated": p.colocated, "link": p.link, "transport": p.transport,
            "kv_bytes": p.kv_bytes, "kv_codec": p.kv_codec, "policy": p.policy, "retries": p.retries,
            "migrations": p.migrations, "link_gbps": round(p.link_gbps, 6), "link_rate_source": p.link_rate_source,
            "link_measured_gbps": round(p.link_measured_gbps, 6), "link_bound": p.link_bound}

    def record(self, error: BaseException | None = None) -> dict:
        """The finished record (``error``: what ended it early; None: it completed).
        A caller that closes the stream after the last message has had all of it."""
        if error is not None and not isinstance(error, Exception) and "finish_reason" in self.fields:
            error = None
        out = dict(self.fields, completion_tokens=self.completion, started=iso(self.started),
                   ttft_ms=None if self.ttft_ms is None else round(self.ttft_ms, 3),
                   duration_ms=round((time.perf_counter() - self.t0) * 1e3, 3))
        if isinstance(error, RouterError):
            out |= {"outcome": error.kind.value, "error": error.message}
        elif error is not None:
            # CancelledError, GeneratorExit: the caller went away
            out |= {"outcome": "internal" if isinstance(error, Exception) else "cancelled",
                    "error": type(error).__name__}
        else:
            out["outcome"] = "ok"
        if self.output is not None:
            out["output"] = "".join(self.output)
        return out
