"""Result types of the offline API, shaped like vLLM's so user code ports unchanged."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenmill.text_buffer import TextBuffer


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
    # a pooling model's request: its vector (an embedding, or a classifier's scores)
    pooled: list[float] | None = None
    # prefill/decode disaggregation: what a prefill request hands its decode request (vLLM's)
    kv_transfer_params: dict[str, Any] | None = None


class OutputKind(enum.Enum):
    """What each result of a streamed request holds (vLLM's `RequestOutputKind`)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # text, ids and logprobs new since the previous result
    FINAL_ONLY = 2  # one result, once the request finished


class OutputSum:
    """Delta results of one request added up; `output()` is the sum so far (the text joined
    only then). Several deltas a slow reader missed become one; a cumulative or final reader
    gets the whole. Each completion's last finish reason, stop reason and cumulative logprob
    win, as do the request's last metrics, prompt logprobs and cached-token count.
    `count_only`: keeps the last delta and the token count, not the sum (a delta reader's)."""

    def __init__(self, count_only: bool = False) -> None:
        self.last: RequestOutput | None = None
        self.num_tokens = 0
        self.count_only = count_only
        self._parts: dict[int, tuple[TextBuffer, list[int], list | None]] = {}

    def add(self, delta: RequestOutput) -> None:
        self.last = delta
        self.num_tokens += sum(len(c.token_ids) for c in delta.outputs)
        if self.count_only:
            return
        for c in delta.outputs:
            parts = self._parts.get(c.index)
            if parts is None:
                parts = self._parts[c.index] = (TextBuffer(), [], None if c.logprobs is None
                                                else [])
            parts[0].append(c.text)
            parts[1].extend(c.token_ids)
            if c.logprobs is not None:
                parts[2].extend(c.logprobs)

    def output(self) -> RequestOutput:
        if self.count_only:
            raise ValueError("this OutputSum keeps no outputs (count_only)")
        last, outputs = self.last, []
        for c in last.outputs:
            text, ids, logprobs = self._parts[c.index]
            outputs.append(CompletionOutput(
                c.index, text.text, list(ids), c.finish_reason,
                None if logprobs is None else list(logprobs), c.stop_reason,
                c.cumulative_logprob))
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, outputs,
                             last.finished, last.prompt_logprobs, last.num_cached_tokens,
                             last.metrics, last.pooled, last.kv_transfer_params)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (the raw logits where activation is off)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """A pooling model's result (vLLM's names): `outputs` an `EmbeddingOutput`,
    `ClassificationOutput` or `ScoringOutput` as asked (`LLM.embed`, `classify`, `score`)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = \
    PoolingRequestOutput
