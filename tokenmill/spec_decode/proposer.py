"""Drafts for the running requests after each step (the engine core calls `propose` with the
requests that just got tokens): which requests speculate, how many tokens each may, and the
proposer of the configured method."""

from __future__ import annotations

import abc
from collections.abc import Iterable

from tokenmill.core.request import Request, RequestStatus
from tokenmill.spec_decode import ngram
from tokenmill.spec_decode.config import SpeculativeConfig


def speculates(request: Request) -> bool:
    """Every running request (penalties, bad words and min_tokens apply per verified row,
    from the context up to it: worker/sampling.py `drafted_batch`; structured outputs mask
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


def make_proposer(config: SpeculativeConfig, engine_config, model_path: str, hf_config,
                  max_model_len: int, num_blocks: int) -> Proposer:
    """The proposer of `config.method` (a draft model: loaded here, its KV cache holding as
    many tokens as the target's, `num_blocks`)."""
    if config.method == "ngram":
        return NgramProposer(config, max_model_len)
    if config.method == "draft_model":
        from tokenmill.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, engine_config, model_path, hf_config, max_model_len,
                                  num_blocks)
    if config.method in ("eagle", "eagle3"):
        from tokenmill.spec_decode.heads import HeadProposer

        return HeadProposer(config, max_model_len)  # (the head loaded by the runner)
    if config.method == "mtp":
        import os

        from tokenmill.loading.checkpoint import resolve_model_path
        from tokenmill.spec_decode.heads import HeadProposer

        if config.model and (os.path.realpath(resolve_model_path(config.model))
                             != os.path.realpath(model_path)):
            raise ValueError("Speculative method 'mtp' runs the target's own MTP layers: "
                             "\"model\" (SPECULATE_MODEL_PATH) must be the target's path or "
                             "left out; MTP layers from a separate checkpoint are not read.")
        return HeadProposer(config, max_model_len)  # (its layers checked by the runner)
    raise ValueError(f"Speculative method {config.method!r} is not served yet; \"ngram\", "
                     "\"draft_model\", \"mtp\" and \"eagle\" are.")
