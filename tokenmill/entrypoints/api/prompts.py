"""Prompt text to token ids for the API servers (HTTP and gRPC share one event loop with the
health and metrics answers): a size check before any tokenizing, and tokenizing or chat
templating of anything but small inputs on a worker thread.

The size check needs no tokenizer run: a token never stands for more characters than the
longest entry of the vocabulary, so a text longer than `max_model_len` such tokens (with a
margin for normalizers that shorten text) cannot fit and is refused at once, however large."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.api.offload import off_loop_if
from tokenmill.sampling_params import InvalidParameter
from tokenmill.tokenizer import ChatTemplateError, apply_chat_template

# Inputs larger than this (characters, or messages) are tokenized / templated on a worker
# thread (`offload.off_loop_if`): the tokenizers release the GIL, so the loop keeps answering.
OFF_LOOP_CHARS = 8192
OFF_LOOP_MESSAGES = 64
# A normalizer may shorten text (NFKC composes "e" + U+0301 into "é"); allow for that.
_NORMALIZER_SLACK = 4


class PromptTooLong(ValueError):
    """The text has more characters than `max_model_len` tokens can hold."""

    def __init__(self, chars: int, max_model_len: int, what: str) -> None:
        super().__init__(f"The {what} is too long: {chars} characters cannot fit in this "
                         f"model's maximum context length of {max_model_len} tokens.")
        self.param = what


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Characters above which no text can fit in `max_model_len` tokens of `tokenizer`."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    longest = max((len(token) for token in vocab), default=16)
    return max_model_len * max(longest, 1) * _NORMALIZER_SLACK


def text_chars(value: Any) -> int:
    """Characters of every string in a request value (messages: nested dicts and lists)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


class PromptEncoder:
    """Tokenizes prompts and renders chat conversations for one API process."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_prompt_chars(tokenizer, max_model_len)
        self._renders_tools: dict[str | None, bool] = {}  # chat template -> whether it does

    def check_size(self, chars: int, what: str) -> None:
        if chars > self.max_chars:
            raise PromptTooLong(chars, self.max_model_len, what)

    async def encode(self, text: str, what: str = "prompt") -> list[int]:
        """A raw prompt: special-token text in it is read as control tokens (the caller wrote
        the whole prompt, template included)."""
        self.check_size(len(text), what)
        return await off_loop_if(len(text) > OFF_LOOP_CHARS, self.tokenizer.encode, text)

    async def render(self, messages: list[dict[str, Any]], what: str = "messages",
                     **kwargs: Any) -> list[int]:
        """A conversation through the chat template (`tokenizer.apply_chat_template`: its
        errors are ChatTemplateError, message text never becomes control tokens)."""
        chars = text_chars(messages)
        self.check_size(chars, what)
        if kwargs.get("tools") and not self.renders_tools(kwargs.get("chat_template")):
            raise InvalidParameter("tools", "This model's chat template does not render tools, "
                                   "so the model would never see them: serve it with a "
                                   "template that does (--chat-template), or leave tools out.")
        heavy = chars > OFF_LOOP_CHARS or len(messages) > OFF_LOOP_MESSAGES
        return await off_loop_if(heavy, apply_chat_template, self.tokenizer, messages,
                                 **kwargs)

    def renders_tools(self, chat_template: str | None) -> bool:
        """Whether `chat_template` (None: the model's) puts a request's tools in the prompt:
        a probe conversation rendered with a tool and without differs. Asked once a template
        (a few dozen kept)."""
        if chat_template not in self._renders_tools:
            if len(self._renders_tools) >= 64:
                self._renders_tools.clear()
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {
                "name": "probe_tool", "description": "probe",
                "parameters": {"type": "object", "properties": {}}}}
            try:
                plain = apply_chat_template(self.tokenizer, probe, chat_template=chat_template)
                with_tool = apply_chat_template(self.tokenizer, probe, tools=[tool],
                                                chat_template=chat_template)
                renders = plain != with_tool
            except ChatTemplateError:
                renders = True  # (the request's own rendering says what is wrong)
            self._renders_tools[chat_template] = renders
        return self._renders_tools[chat_template]
