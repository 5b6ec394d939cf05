"""Typed messages between the API side and the engine core (msgspec: safe to send over ZMQ)."""

from __future__ import annotations

import msgspec

from tokenmill.sampling_params import SamplingParams

# (top ids, top logprobs, chosen logprob, chosen rank) of one position
PositionLogprobs = tuple[list[int], list[float], float, int]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None  # tokenmill.core.request.FinishReason
    stop_reason: int | str | None = None
    new_logprobs: list[PositionLogprobs] | None = None
    # (first prompt position scored, logprobs per position)
    prompt_logprobs: tuple[int, list[PositionLogprobs]] | None = None
    num_cached_tokens: int = 0
