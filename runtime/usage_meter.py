"""A worker's own usage counters per (tenant, link): requests finished,
prompt tokens computed and served by the prefix cache, tokens generated, KV
bytes received, and engine time. Cumulative since the process started (its
incarnation, a random id), they travel in every heartbeat and in the
worker's ``Stats`` (``WorkerLoad.usage``); the router's ledger
(router/cluster/usage.py) adds up the differences.

Engine time: each step's wall time is split among the tenants of the
sequences in it in proportion to the tokens each computed (a prefill chunk's
length, 1 per decoding sequence), in whole nanoseconds that add up to the
step exactly. The services count tokens and requests on the event loop; the
engine thread adds step time through :meth:`UsageMeter.on_step`; a lock
keeps the two apart. One entry per (tenant, link) seen: bounded by the
config's tenants and links."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

from kvrelay.engine.llm_engine import RequestOutput, StepUsage
from kvrelay.runtime.topology import link_name
from kvrelay.v1 import worker_pb2 as wpb


@dataclass(slots=True, frozen=True)
class UsageKey:
    """Whom and which link a worker's work is counted for; also the engine's ``account`` of a sequence."""

    tenant: str
    link: str
    """The KV link ("a-b", "local"); "" when the request's KV crossed none (colocated)."""


UNATTRIBUTED = UsageKey("", "")
"""Engine time of sequences that came without an account."""


@dataclass(slots=True)
class Counters:
    """One key's cumulative counters (the fields of ``TenantUsage``)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    kv_bytes: int = 0
    engine_ns: int = 0


def kv_link(site: str, receiver: str) -> str:
    """The link between this worker's ``site`` and a KV receiver's (its worker
    id, ``site/decode/i``); "" when the receiver is not named."""
    return link_name(site, receiver.partition("/")[0]) if receiver else ""


def split_ns(total_ns: int, shares: dict[UsageKey, int]) -> dict[UsageKey, int]:
    """``total_ns`` split in proportion to ``shares`` (tokens), in whole
    nanoseconds that add up to ``total_ns`` (cumulative rounding)."""
    weight = sum(shares.values())
    if weight <= 0 or total_ns <= 0:
        return {}
    out, acc, given = {}, 0, 0
    for key, n in shares.items():
        acc += n
        upto = total_ns * acc // weight
        out[key] = upto - given
        given = upto
    return out


class UsageMeter:
    """A worker's counters; one per worker process."""

    def __init__(self, incarnation: str | None = None) -> None:
        self.incarnation = incarnation or secrets.token_hex(8)
        """Names this process's run: counters start at zero with each new one."""
        self._lock = threading.Lock()
        self._by_key: dict[UsageKey, Counters] = {}

    def _of(self, key: UsageKey) -> Counters:
        c = self._by_key.get(key)
        if c is None:
            c = self._by_key[key] = Counters()
        return c

    def count(self, key: UsageKey, *, requests: int = 0, prompt_tokens: int = 0, cached_tokens: int = 0,
              completion_tokens: int = 0, kv_bytes: int = 0) -> None:
        """Adds to ``key``'s counters (the event loop's side)."""
        with self._lock:
            c = self._of(key)
            c.requests += requests
            c.prompt_tokens += prompt_tokens
            c.cached_tokens += cached_tokens
            c.completion_tokens += completion_tokens
            c.kv_bytes += kv_bytes

    def count_output(self, key: UsageKey, out: RequestOutput, computed_prompt: bool = False) -> None:
        """A decode worker's output: its tokens, the request when it finished,
        and with ``computed_prompt`` (the first output of a prompt computed
        here) the prompt's computed and cached tokens."""
        prompt = out.num_prompt_tokens - out.num_cached_tokens if computed_prompt else 0
        self.count(key, requests=int(out.finished), completion_tokens=len(out.new_token_ids),
                   prompt_tokens=prompt, cached_tokens=out.num_cached_tokens if computed_prompt else 0)

    def on_step(self, step: StepUsage) -> None:
        """``LLMEngine.step_hook``: the step's time, shared by tokens (the engine thread's side)."""
        shares: dict[UsageKey, int] = {}
        for account, n in step.tokens:
            key = account if isinstance(account, UsageKey) else UNATTRIBUTED
            shares[key] = shares.get(key, 0) + n
        split = split_ns(step.ns, shares)
        with self._lock:
            for key, ns in split.items():
                self._of(key).engine_ns += ns

    def snapshot(self) -> dict[UsageKey, Counters]:
        """A copy of every key's counters."""
        with self._lock:
            return {k: Counters(c.requests, c.prompt_tokens, c.cached_tokens, c.completion_tokens, c.kv_bytes,
                                c.engine_ns) for k, c in self._by_key.items()}

    def protos(self) -> list[wpb.TenantUsage]:
        """The counters as ``WorkerLoad.usage`` carries them (sorted by tenant, link)."""
        return [wpb.TenantUsage(tenant=k.tenant, link=k.link, requests=c.requests, prompt_tokens=c.prompt_tokens,
                                cached_tokens=c.cached_tokens, completion_tokens=c.completion_tokens,
                                kv_bytes=c.kv_bytes, engine_ns=c.engine_ns)
                for k, c in sorted(self.snapshot().items(), key=lambda kv: (kv[0].tenant, kv[0].link))]
