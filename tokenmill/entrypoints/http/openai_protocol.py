"""OpenAI request schemas (pydantic), with vLLM's extra sampling fields, mapped to
SamplingParams. Unknown fields are ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import SamplingParams

MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        # Unset knobs take the neutral values (the seed's models ship no generation config
        # that we read for sampling defaults).
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            seed=self.seed, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens),
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            bad_words=self.bad_words,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)

    def check(self) -> None:
        """Checks pydantic's types cannot express; messages name the field."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server.")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise ValueError("suffix is not supported by this server.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported by this server.")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty.")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true.")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                 f"{self.top_logprobs}.")
        if self.tools and self.tool_choice != "none":
            raise ValueError("tools are not supported by this server.")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported yet.")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def plain_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template; content parts of type text are joined."""
        out = []
        for m in self.messages:
            message = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ValueError("Only text content parts are supported.")
                    parts.append(part["text"])
                message["content"] = "".join(parts)
            elif content is None:
                message["content"] = ""
            out.append(message)
        return out


