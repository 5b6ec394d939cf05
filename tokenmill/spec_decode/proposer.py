"""Drafts for the running requests after each step (the engine core calls `propose` with the
requests that just got tokens): which requests speculate, how many tokens each may, and the
proposer of the configured method."""

from __future__ import annotations

import abc
from collections.abc import Iterable

from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.spec_decode import ngram


def speculates(request: Request) -> bool:
    """Every running request (penalties, bad words and min_tokens apply per verified row,
    from the context up to it: sample/request_sampling.py `drafted_batch`; structured outputs mask
    each verified row after the drafts before it: `mask_drafted`)."""
    return request.status == RequestStatus.RUNNING


class Proposer(abc.ABC):
    """What every method shares: the budget and who speculates; `draft` sets the chosen
    requests' `spec_token_ids` (and `spec_probs` where drafts are sampled)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # drafts the target's step computed (MTP): request id -> (tokens, distributions)
        self.pending: dict = {}

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
        self.release(r.request_id for r in requests if r.status.finished)
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return
        chosen = [(r, k) for r in requests if speculates(r) and (k := self.budget(r)) > 0]
        if chosen:
            self.draft(chosen)

    @abc.abstractmethod
    def draft(self, chosen: list[tuple[Request, int]]) -> None:
        """Set each chosen request's drafts (at most its budget k)."""

    def release(self, request_ids: Iterable[str]) -> None:  # noqa: B027 (most keep nothing)
        """Requests that left the engine: drop what the proposer keeps for them."""


class NgramProposer(Proposer):
    """`pad`: a lookup shorter than the request's budget is filled up to it, repeating its
    last token (the context's, without a match), so that a step's every request carries
    as many drafts and the step runs in a CUDA-graph bucket (the engine sets it where the
    target's drafted steps have buckets); a filler is verified like any draft, and not
    counted as one."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.contexts: dict[str, ngram.Context] = {}  # request id -> its tokens as an array
        self.pad = False

    def draft(self, chosen: list[tuple[Request, int]]) -> None:
        for request, k in chosen:
            context = self.contexts.get(request.request_id)
            if context is None:
                context = self.contexts[request.request_id] = ngram.Context()
            tokens = context.update(request.prompt_token_ids, request.output_token_ids)
            drafts = ngram.propose(tokens, k, self.config.prompt_lookup_min,
                                   self.config.prompt_lookup_max)
            request.spec_padding = k - len(drafts) if self.pad else 0
            if request.spec_padding:
                filler = drafts[-1] if drafts else int(tokens[-1])
                drafts = drafts + [filler] * request.spec_padding
            request.spec_token_ids = drafts

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.contexts.pop(request_id, None)


class HeadProposer(Proposer):
    """The engine core's side: drafts the runner's heads computed, cut to each request's
    budget (`pending` set from each step's output)."""

    def draft(self, chosen) -> None:
        for request, k in chosen:
            got = self.pending.get(request.request_id)
            if got is not None:
                request.spec_token_ids = got[0][:k]
                request.spec_probs = got[1]
        self.pending = {}
