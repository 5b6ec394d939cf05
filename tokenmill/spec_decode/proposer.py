"""Drafts for the running requests after each step (the engine core calls `propose` with the
requests that just got tokens): which requests speculate, and how many tokens each may."""

from __future__ import annotations

from tokenmill.core.request import Request, RequestStatus
from tokenmill.spec_decode import ngram
from tokenmill.spec_decode.config import SpeculativeConfig


def speculates(request: Request) -> bool:
    """Requests whose sampling stays the same over the verified positions: no penalties or
    bad words (they depend on the tokens before each position), and past min_tokens (its
    bans would apply to some of the positions only)."""
    p = request.sampling_params
    return (request.status == RequestStatus.RUNNING and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and not p.bad_words_token_ids
            and request.num_output_tokens >= p.min_tokens)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def budget(self, request: Request) -> int:
        """Drafts the request can use: the step computes its last token and the drafts at the
        positions after it (within max_model_len), and emits at most drafts + 1 tokens
        (within max_tokens)."""
        k = min(self.config.num_speculative_tokens, self.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return max(k, 0)

    def propose(self, requests: list[Request], num_running: int) -> None:
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return
        for request in requests:
            k = self.budget(request)
            if k == 0 or not speculates(request):
                continue
            tokens = request.prompt_token_ids + request.output_token_ids
            request.spec_token_ids = ngram.propose(tokens, k, self.config.prompt_lookup_min,
                                                   self.config.prompt_lookup_max)
