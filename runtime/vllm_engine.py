"""A vLLM pool's engine: vLLM's engine, in the worker's own process, behind
the interface the workers use with kvrelay's engine (``LLMEngine``'s
``add_request``, ``reserve``, ``commit_prefilled``, ``abort_request``,
``step``, ``stats``, ``layout`` and ``cache``), so a vLLM worker is the same
process as a builtin one: it registers, reports load, streams KV through
kvrelay's sealed transports and speaks the same worker protocol.

vLLM runs with its engine core in-process and its single-process executor
(:func:`prepare_process`): the KV tensors it allocates are in this process,
where kvrelay's sender reads them and its receiver writes them. The
connector (runtime/vllm_connector.py) and this engine share a
:class:`~kvrelay.runtime.vllm_connector.Bridge`.

Differences from the builtin engine, by design:

- ``reserve`` answers a future: vLLM allocates blocks when it schedules the
  request, in a step (the decode worker awaits it, with a deadline);
- after the KV arrived, vLLM computes the prompt's last token again and
  samples the first token itself (its own P/D semantics); the prefill
  worker's first token is not used. Greedy outputs are the same.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvrelay.engine.block_pool import KVEvents
from kvrelay.engine.config import ModelConfig, SchedulerConfig
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.engine.llm_engine import EngineStats, RequestOutput, StepUsage
from kvrelay.engine.sampler import TopLogprobs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.runtime.engines import VllmSection
from kvrelay.runtime.vllm_bridge import Bridge, register_bridge, unregister_bridge
from kvrelay.runtime.vllm_events import PrefixEvents

CONNECTOR_MODULE = "kvrelay.runtime.vllm_connector"
CONNECTOR_CLASS = "KvrelayConnector"


@dataclass(slots=True, frozen=True)
class VllmSpec:
    """What a vLLM pool's engine is built from (the pool's section and the cluster's settings)."""

    model_path: Path
    engine_id: str
    """Unique in the process: names this engine's bridge."""
    section: VllmSection
    dtype: str
    device: str
    kv_cache_gib: float
    scheduler: SchedulerConfig
    index_block_size: int = 16
    """The router's prefix-index block size (cache.block_size): prefix-cache events are named in it."""


def prepare_process(threads: int | None, device: str = "cpu") -> None:
    """Sets what vLLM reads from the environment, before it is imported: its engine
    core and model in this process, torch's threads, no pinning of cores (a worker
    shares its host), warnings only in the worker's log; on ``cuda:N``, that device
    as the only one vLLM sees (it runs on the first it sees)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = device.removeprefix("cuda:")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads or os.cpu_count() or 1))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def preload() -> None:
    """Imports what a vLLM engine on the CPU imports (about thirteen seconds on two cores), as
    :func:`prepare_process` has the environment for it: a zygote does this once for the
    vLLM workers it forks (launch/zygote.py). A second call does nothing."""
    prepare_process(None)
    import vllm.config
    import vllm.engine.arg_utils
    import vllm.sampling_params
    import vllm.v1.engine.llm_engine
    import vllm.v1.request
    import vllm.v1.worker.cpu_model_runner
    import vllm.v1.worker.cpu_worker  # noqa: F401  (what an engine on the CPU imports as it starts)

    importlib.import_module(CONNECTOR_MODULE)  # by name, as vLLM loads it: it imports vLLM at its top


def engine_args(spec: VllmSpec):
    """vLLM's EngineArgs for ``spec``, its KV connector kvrelay's."""
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    s, sched = spec.section, spec.scheduler
    cpu = spec.device == "cpu"
    max_len = s.max_model_len or sched.max_model_len
    kv_gib = s.kv_cache_memory_gib or (spec.kv_cache_gib if cpu else None)
    kw: dict[str, Any] = dict(  # vLLM's annotations are narrower than what it accepts (None: its default)
        model=str(spec.model_path), dtype=s.dtype or spec.dtype, seed=0, max_model_len=max_len,
        enforce_eager=cpu if s.enforce_eager is None else s.enforce_eager, block_size=s.block_size,
        tensor_parallel_size=s.tensor_parallel_size, quantization=s.quantization, kv_cache_dtype=s.kv_cache_dtype,
        kv_cache_memory_bytes=int(kv_gib * 2**30) if kv_gib else None,
        enable_prefix_caching=s.enable_prefix_caching, max_num_seqs=s.max_num_seqs or sched.max_num_seqs,
        scheduling_policy="priority",  # kvrelay's priorities: 0 interactive before 1 batch, as vLLM orders them
        # a step's token budget as configured, a prompt longer than it computed in chunks (each chunk's
        # finished blocks stream as it ends: StepSend.end); forcing it up to max_model_len made every long
        # prompt one step, its activations sized to the context window
        max_num_batched_tokens=s.max_num_batched_tokens or sched.max_num_batched_tokens, enable_chunked_prefill=True,
        kv_transfer_config=KVTransferConfig(kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE,
                                            kv_role="kv_both", engine_id=spec.engine_id),
        # events on, published nowhere: VllmEngine puts its own publisher in (runtime/vllm_events.py)
        kv_events_config=KVEventsConfig(enable_kv_cache_events=s.enable_prefix_caching, publisher="null"))
    if s.gpu_memory_utilization is not None:  # else vLLM's own default (a float: it takes no None)
        kw["gpu_memory_utilization"] = s.gpu_memory_utilization
    return EngineArgs(**kw)


def vllm_params(params: SamplingParams, kv: dict):
    """vLLM's SamplingParams for ``params`` (deltas out), carrying kvrelay's ``kv`` transfer params."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VP

    if params.prior_output_tokens and (params.presence_penalty or params.frequency_penalty or params.min_tokens):
        raise InvalidRequestError("presence_penalty, frequency_penalty and min_tokens cannot resume a request on a "
                                  "vLLM pool (vLLM counts only this attempt's output)")
    return VP(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
              top_k=params.top_k or -1, seed=params.seed, stop=list(params.stop) or None,
              stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
              repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
              frequency_penalty=params.frequency_penalty, min_p=params.min_p, min_tokens=params.min_tokens,
              logprobs=params.top_logprobs if params.logprobs else None,
              output_kind=RequestOutputKind.DELTA, extra_args={"kv_transfer_params": {"kvrelay": kv}})


class VllmEngine:
    """vLLM behind kvrelay's engine interface (see the module's docstring)."""

    def __init__(self, spec: VllmSpec) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine as VllmLLMEngine

        self.spec = spec
        self.model_config = ModelConfig.from_file(spec.model_path / "config.json")
        self.bridge = Bridge(model_name=self.model_config.name)
        register_bridge(spec.engine_id, self.bridge)
        self.llm = VllmLLMEngine.from_engine_args(engine_args(spec))
        if self.bridge.cache is None:
            raise RuntimeError("vLLM started without registering its KV cache with kvrelay's connector")
        self.cache: KVCache = self.bridge.cache
        self.layout: KVLayout = self.cache.layout
        self._core = cast(Any, self.llm.engine_core).engine_core  # in-process: the EngineCore itself
        self._salts: dict[str, str] = {}
        """The cache_salt given to vLLM (a digest: vLLM limits its characters) -> kvrelay's salt."""
        self.events = PrefixEvents(spec.index_block_size, self._salts)
        self._core.scheduler.kv_event_publisher = self.events
        self._accounts: dict[str, object] = {}
        self._prompt_len: dict[str, int] = {}
        self._top: dict[str, int] = {}
        """Alternatives each request asked for per token (``top_logprobs``)."""
        self._awaiting: set[str] = set()
        """Reserved requests whose KV has not been committed."""
        self._poke = False
        """A release or receive was signalled: the next step must run to tell vLLM."""
        self._totals = [0, 0]  # prefill, decode tokens computed
        self._seconds = [0.0, 0.0, 0]  # steps with prompt tokens (s), decode-only steps (s), decode-only steps
        self._cached = [0, 0]  # prefix-cache hit tokens, prompt tokens looked up
        self._seen: dict[str, int] = {}
        """Requests with an output already -> prompt tokens their prefix cache held (counted in ``_cached``)."""
        self.step_hook: Callable[[StepUsage], None] | None = None

    # -- requests ------------------------------------------------------------
    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, salt: str, account: object,
             mode: str, priority: int = 0) -> None:
        from vllm.inputs import TokensPrompt

        tp = TokensPrompt(prompt_token_ids=list(prompt))
        if salt:
            vsalt = hashlib.blake2b(salt.encode(), digest_size=16, person=b"kvrelay-vllm").hexdigest()
            self._salts[vsalt] = salt
            tp["cache_salt"] = vsalt
        try:
            self.llm.add_request(request_id, tp, vllm_params(params, {"id": request_id, "mode": mode}),
                                 priority=priority)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(str(exc)) from exc
        self._accounts[request_id] = account
        self._prompt_len[request_id] = len(prompt)
        self._top[request_id] = params.top_logprobs

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, salt: str = "",
                    hold_blocks: bool = False, account: object = None, priority: int = 0) -> None:
        """Queues a request; ``hold_blocks``: a prefill whose blocks stream to a decode worker;
        ``priority``: 0 interactive, 1 batch (vLLM's priority scheduling admits lower values first)."""
        self._add(request_id, prompt_token_ids, params, salt, account, "send" if hold_blocks else "none", priority)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, salt: str = "",
                account: object = None) -> concurrent.futures.Future:
        """Queues a request whose prompt KV will arrive from a prefill worker; the future
        answers (block ids, first block to fill) once vLLM allocated them."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.bridge.reservations[request_id] = fut
        try:
            self._add(request_id, prompt_token_ids, params, salt, account, "recv")
        except InvalidRequestError:
            self.bridge.reservations.pop(request_id, None)
            raise
        self._awaiting.add(request_id)
        return fut

    def commit_prefilled(self, request_id: str, first_token: int, logprob: float | None,
                         top: TopLogprobs | None = None) -> None:
        """The KV of a reserved request is in its blocks: vLLM may run it (the first token is its own)."""
        iid = self.bridge.internal.get(request_id)
        if request_id not in self._awaiting or iid is None:
            raise InvalidRequestError(f"request {request_id!r} has no reservation waiting for KV")
        self._awaiting.discard(request_id)
        self.bridge.received.add(iid)
        self._poke = True

    def abort_request(self, request_id: str) -> bool:
        """Ends a request; a finished prefill's held blocks are released (the transfer ended)."""
        from vllm.v1.request import RequestStatus

        fut = self.bridge.reservations.pop(request_id, None)
        if fut is not None:
            fut.cancel()
        iid = self.bridge.internal.pop(request_id, None)
        self._forget(request_id)
        if request_id in self.bridge.held and iid is not None:
            self.bridge.held.discard(request_id)
            self.bridge.sent.add(iid)
            self._poke = True
            return True
        req = self._core.scheduler.requests.get(iid) if iid is not None else None
        parked = request_id in self._awaiting and req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        self._awaiting.discard(request_id)
        self.llm.abort_request([request_id])
        if parked and iid is not None:  # its blocks are freed once reported received: nothing writes to them any more
            self.bridge.received.add(iid)
            self._poke = True
        return req is not None

    def _forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        self.bridge.local_hits.pop(request_id, None)
        self._accounts.pop(request_id, None)
        self._prompt_len.pop(request_id, None)
        self._top.pop(request_id, None)

    # -- stepping ------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Work a step would advance (requests parked for their KV need none), or a step vLLM's batch
        queue still holds (async scheduling, on GPUs: its outputs come with a later step; vLLM's own
        ``EngineCore.has_work`` counts it too; CPU builds run without one)."""
        parked = sum(1 for r in self._awaiting if r not in self.bridge.reservations)
        return (self._poke or self._core.scheduler.get_num_unfinished_requests() > parked
                or bool(self._core.batch_queue))

    @property
    def num_reserved(self) -> int:
        return len(self._awaiting)

    @property
    def num_held(self) -> int:
        return len(self.bridge.held)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter_ns()
        outs = self.llm.step()
        self._poke = False
        ns = time.perf_counter_ns() - t0
        before = self._totals[0]
        tokens = self._count_step()
        self._time_step(ns, bool(tokens), self._totals[0] > before)
        results = [self._convert(o) for o in outs]
        if self.step_hook is not None and tokens:
            self.step_hook(StepUsage(ns, [(self._accounts.get(r), n) for r, n in tokens], [r for r, _ in tokens],
                                     time.time_ns()))
        return results

    def _count_step(self) -> list[tuple[str, int]]:
        """(kvrelay id, tokens) of the step just run, counted as prefill or decode."""
        out = []
        for rid, computed, n in self.bridge.step_tokens:
            prompt = self._prompt_len.get(rid, 0)
            pre = min(n, max(0, prompt - computed))
            self._totals[0] += pre
            self._totals[1] += n - pre
            out.append((rid, n))
        self.bridge.step_tokens = []
        return out

    def _time_step(self, ns: int, computed: bool, prompt: bool) -> None:
        """A step that computed prompt tokens counts as prefill time (as the builtin engine counts a mixed step)."""
        if not computed:
            return
        if prompt:
            self._seconds[0] += ns / 1e9
        else:
            self._seconds[1] += ns / 1e9
            self._seconds[2] += 1

    def _convert(self, o) -> RequestOutput:
        c = o.outputs[0]
        ids = list(c.token_ids)
        lps: list[float] = []
        tops: list[TopLogprobs] = []
        k = self._top.get(o.request_id, 0)
        if c.logprobs:
            for tok, entry in zip(ids, c.logprobs):
                lps.append(float(entry[tok].logprob))
                # vLLM adds the sampled token to the top k even when it ranks below them
                ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items()
                                if lp.rank is not None and lp.rank <= k)
                tops.append(TopLogprobs([t for _, t, _ in ranked], [float(lp) for _, _, lp in ranked]))
        finished = bool(o.finished)
        cached = self._seen.get(o.request_id)
        if cached is None:
            # a received prompt: what this worker's cache held (vLLM counts the KV that arrived as cached too)
            cached = self._seen[o.request_id] = self.bridge.local_hits.pop(o.request_id, o.num_cached_tokens or 0)
            self._cached[0] += cached
            self._cached[1] += len(o.prompt_token_ids or ())
        if finished and o.request_id not in self.bridge.held:
            self.bridge.internal.pop(o.request_id, None)
            self._forget(o.request_id)
        return RequestOutput(o.request_id, ids, c.text, finished, c.finish_reason if finished else None,
                             len(o.prompt_token_ids or ()), cached, lps if c.logprobs else [],
                             tops if c.logprobs and k else [])

    # -- what the worker reports ---------------------------------------------
    def stats(self) -> EngineStats:
        sched = self._core.scheduler
        pool = sched.kv_cache_manager.block_pool
        bs = self.layout.block_size
        parked = {self.bridge.internal.get(r) for r in self._awaiting}
        queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in (*sched.waiting, *sched.running)
                     if r.request_id not in parked)
        pre_s, dec_s, dec_steps = self._seconds
        return EngineStats(num_running=len(sched.running), num_waiting=len(sched.waiting),
                           num_free_blocks=pool.get_num_free_blocks(), num_blocks=pool.num_gpu_blocks - 1,
                           num_prefill_tokens=self._totals[0], num_decode_tokens=self._totals[1],
                           num_preemptions=0, prefix_hit_blocks=self._cached[0] // bs,
                           prefix_query_blocks=self._cached[1] // bs, queued_prefill_tokens=queued,
                           prefill_tokens_per_s=self._totals[0] / pre_s if pre_s else 0.0,
                           decode_step_s=dec_s / dec_steps if dec_steps else 0.0)

    def drain_kv_events(self, snapshot: bool = False) -> KVEvents:
        """vLLM's prefix-cache changes named as the router's index names blocks (runtime/vllm_events.py)."""
        return self.events.drain(snapshot)

    def close(self) -> None:
        unregister_bridge(self.spec.engine_id)
