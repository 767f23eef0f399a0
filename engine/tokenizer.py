"""Tokenizer (``tokenizer.json`` through the ``tokenizers`` library) and chat
template (jinja2, rendered the way Hugging Face renders it), plus an
incremental detokenizer for streaming text."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvrelay.engine.errors import CheckpointError, InvalidRequestError

ChatMessage = dict[str, str]


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE
    vocabulary writes for each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_level(tok: HFTokenizer) -> bool:
    """Whether the decoder maps pieces through the byte-level alphabet."""
    dec = tok.decoder
    try:
        return dec is not None and b'"ByteLevel"' in dec.__getstate__()
    except Exception:  # a decoder type this library version cannot serialise
        return False


class Tokenizer:
    """Text <-> token ids for one checkpoint."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise CheckpointError(f"{path}: tokenizer.json not found")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises a bare Exception
            raise CheckpointError(f"{tok_file}: cannot load tokenizer ({exc})") from None
        cfg: dict = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.exists():
            try:
                cfg = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{cfg_file}: invalid JSON ({exc})") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._added = frozenset(self._tok.get_added_tokens_decoder())
        self._byte_level = _is_byte_level(self._tok)
        self._bytes: dict[int, bytes] = {}
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(template)
            except TemplateError as exc:
                raise CheckpointError(f"{path}: chat template does not compile ({exc})") from None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode does not): a long
        # prompt tokenized in a thread leaves the caller's event loop running
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes ``token_id`` stands for in decoded text (cached).

        A byte-level BPE token may be part of a UTF-8 character: the bytes
        of consecutive tokens concatenate to the text's UTF-8 bytes. Added
        (special) tokens give their text; an id outside the vocabulary b"".
        """
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._token_bytes(token_id)
        return b

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:  # not from the byte alphabet
                return piece.encode()
        m = _BYTE_FALLBACK.fullmatch(piece)  # SentencePiece byte fallback
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # Metaspace word boundary

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for chat ``messages`` (dicts with role and content)."""
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}] needs string 'role' and 'content'")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from None

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for chat messages, exactly as the model was trained
        (special tokens come from the template, none are added)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def encode_prompt(self, text: str, raw: bool = False) -> list[int]:
        """Token ids for a plain prompt: a one-message user chat through the chat
        template when the model has one and ``raw`` is false, else ``text`` as is."""
        if self.has_chat_template and not raw:
            return self.encode_chat([{"role": "user", "content": text}])
        return self.encode(text)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back bytes
    of an incomplete UTF-8 character and text that may still become a stop
    string."""

    _CONTEXT = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-self._CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        """All output text so far (stop string excluded once found)."""
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int, check_stop: bool = True) -> None:
        """Feeds one generated token; sets ``stopped`` when a stop string appears
        (looked for only with ``check_stop``: not before a request's ``min_tokens``)."""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        start = max(0, len(self.text) - self._holdback)
        self.text += delta
        for s in self._stop if check_stop else ():
            pos = self.text.find(s, start)
            if pos != -1:
                self.text = self.text[:pos]
                self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet handed out; ``final`` releases the held-back tail."""
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out
