"""A request as the engine tracks it: tokens, blocks, progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvrelay.engine.hashing import BlockHash, hash_blocks
from kvrelay.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """One request inside the engine.

    ``num_computed_tokens`` counts tokens whose KV is in ``block_table``'s
    blocks; the next step computes tokens from there on.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    """Sampling seed (the request's, or one drawn at admission)."""
    salt: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache at first admission."""
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chained hashes of this sequence's full blocks computed so far."""
    num_registered_blocks: int = 0
    """Leading blocks already offered to the prefix cache."""
    priority: int = 0
    """Scheduling class: waiting sequences of a lower value are admitted first
    (0 interactive, 1 batch); arrival order within a class."""
    account: object = None
    """Whom the caller accounts this sequence's compute to (opaque to the
    engine, handed back in :class:`~engine.llm_engine.StepUsage`)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens so far, an earlier attempt's included (``params.prior_output_tokens``):
        the sampled token's index, and what ``min_tokens`` counts."""
        return self.params.prior_output_tokens + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def hashes_up_to(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """Extends and returns the hash chain to cover ``num_blocks`` full blocks."""
        have = len(self.block_hashes)
        if num_blocks > have:
            toks = self.tokens(0, num_blocks * block_size)
            parent = self.block_hashes[-1] if have else None
            self.block_hashes.extend(hash_blocks(toks, block_size, self.salt, parent, have))
        return self.block_hashes[:num_blocks]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
