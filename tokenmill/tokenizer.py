"""Tokenizer loading, chat templates, and incremental detokenization of generated tokens."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import weakref
from typing import Any

from tokenmill.text_buffer import TextBuffer

logger = logging.getLogger(__name__)

# Prompt tokens given to the detokenizer as context, so the first generated token is decoded
# as it reads after the prompt (leading spaces of SentencePiece tokens, merged bytes).
_PROMPT_CONTEXT_TOKENS = 5


def eos_token_ids(tokenizer: Any, model_path: str) -> list[int]:
    """EOS ids from the tokenizer plus `generation_config.json` (which may list several)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_config = os.path.join(model_path, "generation_config.json")
    if os.path.isdir(model_path) and os.path.isfile(gen_config):
        with open(gen_config) as f:
            value = json.load(f).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Token sequences to forbid for each bad word: as written and with a leading space
    (mid-sentence form), as vLLM does."""
    seen: dict[tuple[int, ...], None] = {}  # ordered and de-duplicated in linear time
    for word in words:
        for form in (word.strip(), " " + word.strip()):
            ids = tuple(tokenizer.encode(form, add_special_tokens=False))
            if ids:
                seen.setdefault(ids, None)
    return [list(ids) for ids in seen]


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the chat template (the caller's problem: 400)."""

    param = "messages"


class _ControlTokens:
    """A tokenizer's special tokens (BOS/EOS, `<|im_start|>`, `[INST]`...): a pattern that finds
    their text in a string, and an encoder that reads such text as plain characters. Built
    once per tokenizer; the plain encoder (a copy of the fast tokenizer's backend with
    special-token parsing off, so no shared flag is flipped while other threads encode) only
    when first needed: copying a large vocabulary takes ~0.2 s."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: Any) -> None:
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        texts = {t.content for t in decoder.values() if getattr(t, "special", False)}
        texts |= set(getattr(tokenizer, "all_special_tokens", []) or [])
        texts = sorted((t for t in texts if t), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self.tokenizer = tokenizer
        self._plain = None

    @classmethod
    def of(cls, tokenizer: Any) -> _ControlTokens:
        try:
            found = cls._cache.get(tokenizer)
        except TypeError:  # not weak-referenceable: build each time
            return cls(tokenizer)
        if found is None:
            found = cls._cache[tokenizer] = cls(tokenizer)
        return found

    def encode_plain(self, text: str) -> list[int]:
        """`text` with any special-token text in it tokenized as ordinary characters."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False,
                                         split_special_tokens=True)
        if self._plain is None:  # a race here only builds the same copy twice
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids


class _ContentGuard:
    """Keeps request text from becoming control tokens when a chat template renders it.

    In every string of the messages (content, role, name, tool-call arguments, ...) each
    occurrence of a special token's text is swapped for a unique placeholder before
    rendering; the rendered text is tokenized as usual around the placeholders (the
    template's own control tokens stay control tokens), and each placeholder's special-token
    text is tokenized as plain text. Only the token's text is swapped, never the string
    around it, so a template that escapes the string (`tojson` for tool-call arguments)
    escapes all of it as it would anyway; the placeholder is ASCII letters and digits, which
    no escaping changes. A conversation without such text renders and tokenizes exactly as
    before."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokens = _ControlTokens.of(tokenizer)
        self.tokenizer = tokenizer
        self.originals: dict[str, str] = {}
        self._nonce = secrets.token_hex(8)

    def protect(self, value: Any) -> Any:
        """`value` (messages, kwargs: nested dicts, lists, strings) with risky strings swapped."""
        if isinstance(value, str):
            if self.tokens.pattern is None or not self.tokens.pattern.search(value):
                return value
            return self.tokens.pattern.sub(self._placeholder, value)
        if isinstance(value, dict):  # keys too: a tool's parameter names are request text
            return {self.protect(k): self.protect(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.protect(v) for v in value]
        return value

    def _placeholder(self, match: re.Match) -> str:
        key = f"tmguard{self._nonce}n{len(self.originals)}x"
        self.originals[key] = match.group(0)
        return key

    def encode(self, rendered: str) -> list[int]:
        if not self.originals:
            return self.tokenizer.encode(rendered, add_special_tokens=False)
        pieces = re.split(f"(tmguard{self._nonce}n\\d+x)", rendered)
        ids: list[int] = []
        for piece in pieces:
            if piece in self.originals:
                ids += self.tokens.encode_plain(self.originals[piece])
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the value itself where it is a template (as
    vLLM reads it); a value that names no readable file and holds no template is named."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        if "{" in value or "\n" in value:
            return value
        raise ValueError(f"--chat-template {value!r} looks like a file, but it cannot be read "
                         f"({exc.strerror or exc}).") from None


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, chat_template: str | None = None,
                        **kwargs: Any) -> list[int]:
    """Renders in transformers' sandboxed Jinja environment (ImmutableSandboxedEnvironment):
    a template that reaches for Python internals fails with a SecurityError instead of
    running, and message content is data, never template code. Text in the messages that
    spells a special token (`<|im_end|>`, `<|im_start|>system`) is tokenized as plain text,
    so a user cannot close their turn and forge another; the template's own control tokens
    are unaffected."""
    import jinja2
    from jinja2.sandbox import SecurityError

    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError("This model has no chat template; send a plain prompt instead.")
    guard = _ContentGuard(tokenizer)
    try:
        text = tokenizer.apply_chat_template(guard.protect(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template,
                                             **guard.protect(kwargs))
    except SecurityError:
        logger.warning("the chat template attempted an unsafe operation; refused")
        raise ChatTemplateError("The chat template attempted an operation that is not "
                                "allowed.") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        # Templates reject conversations with raise_exception (e.g. roles not alternating).
        raise ChatTemplateError(f"The messages do not fit the chat template: {exc}") from None
    # The template already wrote BOS where the model wants it.
    return guard.encode(text)


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas.

    Each step decodes only a short window: text of tokens [prefix, read) is already emitted,
    and new text is what [prefix, end) adds beyond it, held back while it ends in an
    incomplete UTF-8 sequence (U+FFFD). Where the tokenizer is a `tokenizers` one decoded
    as it is (`token_decoder`), its `DecodeStream` runs that same algorithm in Rust (0.8 vs
    2.2 us per token); this class keeps the window's indices beside it, and the Python
    steps (`_advance`) are the reference and take over where the stream cannot follow: the
    final flush of held-back bytes, a prompt whose text ends in an incomplete character, a
    window whose text stops extending the emitted one (the stream raises)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._decode = token_decoder(tokenizer, skip_special_tokens)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text: str | None = None  # text of [prefix, read), until they move
        self._text = TextBuffer()  # (`str +=` copied the whole text per token)
        self._backend = plain_backend(tokenizer)
        self._skip = skip_special_tokens
        self._stream: Any = _UNSET  # (made on the first tokens: the prompt is checked then)

    def _start_stream(self):
        if self._backend is None:
            return None
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith("\ufffd"):
            return None
        return _decode_stream(self._ids, self._skip)

    def add_tokens(self, token_ids: list[int], final: bool = False) -> str:
        """`final`: the sequence ended, so flush held-back bytes even if incomplete."""
        if self._stream is _UNSET:
            self._stream = self._start_stream()
        delta = ""
        last = len(token_ids) - 1
        for i, token in enumerate(token_ids):
            self._ids.append(token)
            flush = final and i == last
            if self._stream is not None and not flush:
                delta += self._step(token)
            else:
                self._stream = None  # (the window moves here: the stream would not follow)
                delta += self._advance(flush)
        if final and not token_ids:
            delta += self._advance(True)
        self._text.append(delta)
        return delta

    @property
    def text(self) -> str:
        return self._text.text

    @text.setter
    def text(self, value: str) -> None:
        self._text.text = value

    @property
    def text_length(self) -> int:
        return self._text.length

    def tail(self, start: int) -> str:
        """The text from character `start` on, joining only the pieces it spans."""
        return self._text.tail(start)

    def _step(self, token: int) -> str:
        """`_advance` without a flush, through the stream."""
        try:
            piece = self._stream.step(self._backend, token)
        except Exception:  # noqa: BLE001 - its state is unknown now: the reference goes on
            self._stream = None
            return self._advance(False)
        if piece is None:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        return piece

    def _advance(self, flush: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        prefix_text = self._prefix_text
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) > len(prefix_text) and (flush or not full_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = None
            return full_text[len(prefix_text):]
        return ""


_UNSET = object()


def _decode_stream(ids: list[int], skip_special_tokens: bool):
    """A `tokenizers` DecodeStream after `ids`; None where the installed tokenizers has none
    that takes context ids (before 0.22)."""
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(ids), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None


def plain_backend(tokenizer: Any):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer that cleans up no
    spaces (its decode is the backend's as it is), else None."""
    import tokenizers

    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True):
        return backend
    return None


def token_decoder(tokenizer: Any, skip_special_tokens: bool = True):
    """ids -> text, as `tokenizer.decode(ids, skip_special_tokens=...)`. A transformers fast
    tokenizer that cleans up no spaces is decoded by its `tokenizers` backend directly: the
    wrapper's argument checks cost ~10x the decode of a few tokens, twice per token of every
    sequence (the incremental detokenizer)."""
    backend = plain_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
