"""The engine interface the workers drive: what kvrelay's engine (engine/llm_engine.py)
and a vLLM pool's (runtime/vllm_engine.py) both provide. A Protocol, so neither
inherits from it and this package never imports vLLM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvrelay.engine.block_pool import KVEvents
from kvrelay.engine.config import ModelConfig
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.engine.llm_engine import EngineStats, RequestOutput, StepUsage
from kvrelay.engine.sampling_params import SamplingParams


class WorkerEngine(Protocol):
    """An engine a worker steps on its engine thread (engine/async_engine.py)."""

    layout: KVLayout
    cache: KVCache
    model_config: ModelConfig
    step_hook: Callable[[StepUsage], None] | None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, salt: str = "",
                    hold_blocks: bool = False, account: object = None, priority: int = 0) -> None: ...

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, salt: str = "",
                account: object = None) -> Any:
        """(block ids, first block to fill), or a concurrent future of them (vLLM allocates in a step)."""

    def commit_prefilled(self, request_id: str, first_token: int, logprob: float | None) -> RequestOutput | None:
        """The reserved request's KV arrived: its first output, or None when the engine samples it in a step."""

    def abort_request(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def drain_kv_events(self, snapshot: bool = False) -> KVEvents: ...

    @property
    def num_reserved(self) -> int: ...

    @property
    def num_held(self) -> int: ...
