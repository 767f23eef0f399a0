"""Per-request sampling parameters, validated on construction so every
front end (gRPC, HTTP, batch jobs) shares one source of truth."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrelay.engine.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
"""Most stop strings a request may carry."""
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask for (OpenAI's limit)."""


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop."""

    max_tokens: int = 128
    """Most tokens to generate (>= 1)."""
    temperature: float = 0.0
    """0 means greedy; otherwise logits are divided by it (<= 100)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    seed: int | None = None
    """Makes sampling reproducible: token i depends only on (seed, i, logits)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; they are not part of the output text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (in addition to the model's EOS)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks force output lengths with this)."""
    logprobs: bool = False
    """Return the log-probability of each chosen token."""
    top_logprobs: int = 0
    """Also return the k most likely tokens at each position and their
    log-probabilities (0..MAX_TOP_LOGPROBS; needs ``logprobs``)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) \
                or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequestError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"a stop string is {len(s)} characters; the limit is {MAX_STOP_STRING_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_request_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Raises InvalidRequestError when a prompt and its output cannot fit the
    context window. Shared by the engine and every front end."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError("prompt is empty")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(f"prompt is {num_prompt_tokens} tokens; the context window is {max_model_len} "
                                  "tokens (prompt + output)")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                                  f"context window of {max_model_len} tokens")
