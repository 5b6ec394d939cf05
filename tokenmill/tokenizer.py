"""Tokenizer loading, chat templates, and incremental detokenization of generated tokens."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

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
    sequences: list[list[int]] = []
    for word in words:
        for form in (word.strip(), " " + word.strip()):
            ids = tokenizer.encode(form, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


# Texts longer than this are tokenized / templated on a worker thread by the API servers (the
# tokenizers release the GIL), so one huge prompt does not stall every other request's stream.
OFF_LOOP_CHARS = 8192


async def off_loop_if_long(size: int, fn, *args: Any, **kwargs: Any):
    """`fn(*args, **kwargs)`, on a worker thread when `size` (characters) is large."""
    if size > OFF_LOOP_CHARS:
        import asyncio

        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the chat template (the caller's problem: 400)."""

    param = "messages"


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, chat_template: str | None = None,
                        **kwargs: Any) -> list[int]:
    """Renders in transformers' sandboxed Jinja environment (ImmutableSandboxedEnvironment):
    a template that reaches for Python internals fails with a SecurityError instead of
    running, and message content is data, never template code."""
    import jinja2
    from jinja2.sandbox import SecurityError

    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError("This model has no chat template; send a plain prompt instead.")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **kwargs)
    except SecurityError:
        logger.warning("the chat template attempted an unsafe operation; refused")
        raise ChatTemplateError("The chat template attempted an operation that is not "
                                "allowed.") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        # Templates reject conversations with raise_exception (e.g. roles not alternating).
        raise ChatTemplateError(f"The messages do not fit the chat template: {exc}") from None
    # The template already wrote BOS where the model wants it.
    return tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas.

    Each step decodes only a short window: text of tokens [prefix, read) is already emitted,
    and new text is what [prefix, end) adds beyond it, held back while it ends in an
    incomplete UTF-8 sequence (U+FFFD)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int], final: bool = False) -> str:
        """`final`: the sequence ended, so flush held-back bytes even if incomplete."""
        delta = ""
        for i, token in enumerate(token_ids):
            self._ids.append(token)
            delta += self._advance(final and i == len(token_ids) - 1)
        if final and not token_ids:
            delta += self._advance(True)
        self.text += delta
        return delta

    def _advance(self, flush: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) > len(prefix_text) and (flush or not full_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text):]
        return ""
