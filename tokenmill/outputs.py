"""Result types of the offline API, shaped like vLLM's so user code ports unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One position: token id -> its Logprob (the chosen token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # epoch seconds arrival_time, first_scheduled_time, first_token_time, last_token_time
    # (those passed so far); num_draft_tokens / num_accepted_tokens (speculative decoding);
    # kv_cache_reused_blocks / kv_cache_total_blocks (once finished)
    metrics: dict[str, float] = field(default_factory=dict)
