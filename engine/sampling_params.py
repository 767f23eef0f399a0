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
RANGES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0), "min_p": (0.0, 1.0)}
"""Closed bounds of the float extensions (vLLM's); ``repetition_penalty`` is in (0, 2]."""
MAX_MIN_TOKENS = 1 << 20
"""Bound of ``min_tokens`` (a context window is far shorter; checked against max_tokens by the router)."""


def _number_in(value: object, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and low <= value <= high


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
    repetition_penalty: float = 1.0
    """Scales the logits of every token already in the prompt or the output
    (divides a positive logit, multiplies a negative one; vLLM's rule);
    1 disables, > 1 discourages repeats. In (0, 2]."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the output already holds
    (OpenAI's rule). In [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it. In [-2, 2]."""
    min_p: float = 0.0
    """Drop tokens whose probability (after temperature) is below ``min_p``
    times the most likely token's. In [0, 1]; 0 disables."""
    min_tokens: int = 0
    """Generate at least this many tokens: until then EOS and ``stop_token_ids``
    cannot be sampled and stop strings do not end the output."""
    prior_output_tokens: int = 0
    """How many trailing prompt tokens are this request's own earlier output
    (a request resumed after its decode worker failed): they count as output
    for the penalties, ``min_tokens`` and a seeded request's token index."""
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
        self._check_penalties()

    def _check_penalties(self) -> None:
        if not _number_in(self.repetition_penalty, 0.0, 2.0) or self.repetition_penalty == 0.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        for name, (low, high) in RANGES.items():
            if not _number_in(getattr(self, name), low, high):
                raise InvalidRequestError(f"{name} must be in [{low:g}, {high:g}], got {getattr(self, name)!r}")
        for name in ("min_tokens", "prior_output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MIN_TOKENS:
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_MIN_TOKENS}], got {value!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

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
