"""Log-probabilities in the OpenAI shapes, from a stream's ``GenerateResponse``
fields (``token_ids``, ``logprobs``, ``top_logprobs``).

Each token is shown as its exact bytes (``Tokenizer.token_bytes``: a
byte-level BPE token may be part of a UTF-8 character) and as those bytes
decoded with ``errors="replace"`` (a partial character reads as U+FFFD);
concatenating the bytes of consecutive tokens gives the text's UTF-8 bytes.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from kvrelay.engine.tokenizer import Tokenizer

NEG_INF_LOGPROB = -9999.0
"""What a logprob of -inf (or NaN) is shown as: JSON has no infinity (OpenAI's convention)."""


def _lp(value: float) -> float:
    return float(value) if math.isfinite(value) else NEG_INF_LOGPROB


def _pairs(top) -> list[tuple[int, float]]:
    """(token id, logprob) of one position's alternatives: a ``TopLogprobs``
    message or dataclass (``token_ids``, ``logprobs``), or pairs already."""
    if hasattr(top, "token_ids"):
        return list(zip(top.token_ids, top.logprobs))
    return [(int(t), float(lp)) for t, lp in top]


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _chat_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict:
    b = tokenizer.token_bytes(token_id)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": _lp(logprob), "bytes": list(b)}


def _text_offsets(tokenizer: Tokenizer, token_ids: list[int], start: int) -> list[int]:
    """Where each token starts in the text, in characters from ``start``: the
    characters completed before it (a token that continues a character starts
    at that character)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, pos = [], start
    for t in token_ids:
        offsets.append(pos)
        pos += len(dec.decode(tokenizer.token_bytes(t)))
    return offsets


def openai_logprobs(tokenizer: Tokenizer, chat: bool, token_ids: list[int], logprobs: list[float],
                    tops: Sequence, *, text_offset: int = 0) -> dict | None:
    """The ``logprobs`` object of one choice (or one streamed chunk of it).

    ``token_ids`` and ``logprobs`` are a response's fields of those names (or
    several messages' concatenated); ``tops`` its ``top_logprobs`` (one per
    token id; empty when the request asked for none). ``text_offset``
    (completions only): characters of this choice's text before these tokens
    (for a streamed chunk, the length of the text already sent).

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}, ...]}, ...]}``. Completions: ``{"tokens",
    "token_logprobs", "top_logprobs": [{token: logprob, ...}, ...] or None,
    "text_offset"}``. None when there are no logprobs (not requested, or a
    message without tokens).
    """
    if not logprobs:
        return None
    token_ids = list(token_ids)[:len(logprobs)]
    alts = [_pairs(t) for t in tops][:len(token_ids)] if tops else None
    if chat:
        content = []
        for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
            entry = _chat_entry(tokenizer, t, lp)
            entry["top_logprobs"] = [_chat_entry(tokenizer, a, alp) for a, alp in alts[i]] \
                if alts and i < len(alts) else []
            content.append(entry)
        return {"content": content}
    top_dicts = None
    if alts:
        top_dicts = []
        for pairs in alts:
            d: dict[str, float] = {}
            for a, alp in pairs:  # most likely first: two ids with one text keep the likelier
                d.setdefault(_text(tokenizer, a), _lp(alp))
            top_dicts.append(d)
    return {"tokens": [_text(tokenizer, t) for t in token_ids], "token_logprobs": [_lp(lp) for lp in logprobs],
            "top_logprobs": top_dicts, "text_offset": _text_offsets(tokenizer, token_ids, text_offset)}
