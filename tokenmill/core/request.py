"""A request's state inside the engine core: its tokens, how many are computed, its status."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.mm_inputs import cache_key
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.IntEnum):
    """Sent over the process boundary as an int; `str()` gives the OpenAI/vLLM spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self]


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(eq=False)
class Request:
    """`num_computed_tokens` chases `num_tokens`: prefill, chunked prefill, decode, prefix hits
    and recompute after preemption are all just different increments of it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first scheduling; -1 = not yet
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # speculative decoding: draft tokens for the next step, verified by it (not yet tokens)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: Any = None  # the distributions they were drawn from (None: one-hot)
    spec_padding: int = 0  # trailing drafts that only fill a graph bucket (not counted)
    num_draft_tokens: int = 0  # drafts verified for this request, and accepted
    num_accepted_tokens: int = 0
    # state layers: which row of its state slot its next step reads (ScheduledRequest's)
    state_row: int = 0
    grammar: Any = None  # structured outputs: its GrammarState (structured_output/manager.py)
    # tokens sampled by steps in flight, not appended yet (one per such step; asynchronous
    # scheduling launches the next step, computing at that token's position, before it lands)
    num_pending: int = 0
    # LoRA: the adapter it runs with (lora/request.py's LoRARequest; None: the base model)
    lora_request: Any = None
    priority: int = 0  # --scheduling-policy priority: lower runs first
    tenant: str = ""  # --scheduling-policy fair: whose share it runs in (config/tenants.py)
    # the seconds it may wait for its first step (--max-queue-time), and the monotonic time
    # that ends at: it is refused after it
    max_queue_time: float | None = None
    deadline: float | None = None
    # a pooling model's request (pooling_params.py's PoolingParams): it ends once its prompt
    # is computed, with a vector instead of tokens; one pooling every row (mean, max, CLS)
    # reads no prefix-cache hit
    pooling_params: Any = None
    skip_prefix_cache: bool = False
    # an image-text model's images (mm_inputs.py's MultiModalInput), in prompt order
    mm_inputs: list = field(default_factory=list)
    num_encoded_images: int = 0  # those a step was scheduled to encode (the runner keeps them)

    @property
    def lora_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def cache_root(self) -> bytes | None:
        """What its first block's prefix-cache hash starts from: its adapter's key and its
        images' (the same tokens under another adapter, or with other images, never share
        KV); None: the base model's, text only."""
        root = self.lora_request.cache_key() if self.lora_request is not None else None
        if self.mm_inputs:
            root = (root or b"") + cache_key(self.mm_inputs)
        return root

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def samples_from_history(self) -> bool:
        """Whether sampling its next token reads the tokens before it (penalties, bad words,
        a `min_tokens` still to reach)."""
        return self._penalized or self.num_outputs_before_draw < self.sampling_params.min_tokens

    @property
    def num_outputs_before_draw(self) -> int:
        """While a step samples its next token: its output tokens before that one, those of
        earlier steps still in flight included (its pending count less that step's own);
        `min_tokens` bans by it."""
        return len(self.output_token_ids) + max(self.num_pending - 1, 0)

    @property
    def may_schedule_async(self) -> bool:
        """Whether its next step may be scheduled before its pending token is on the host
        (asynchronous scheduling): nothing of that step needs the token but the forward
        and the penalties, which take it from the device (no bad words, which match the
        tokens on the host; no grammar). `min_tokens` counts pending tokens."""
        return (not self.sampling_params.bad_words_token_ids and self.grammar is None
                and self.pooling_params is None)

    @functools.cached_property
    def _penalized(self) -> bool:
        """Penalties or bad words: its sampling reads its tokens at every step."""
        p = self.sampling_params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0 or bool(p.bad_words_token_ids))

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)
