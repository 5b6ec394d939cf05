"""A launched step and what it yields: its logits sampled (`sample_step`: plain rows' tokens
left on the device with their copy to the host started, drafted rows verified) and its prompt
tokens scored (`score_prompt`); `RunnerOutput` is what the engine core gets back."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.core.scheduler import ScheduledRequest
from tokenmill.distributed.pipeline import PendingLogits
from tokenmill.host_to_device import HostCopy
from tokenmill.sample.grammar_mask import mask_drafted, mask_rows
from tokenmill.sample.rejection_sampler import verify_many
from tokenmill.sample.request_sampling import RequestSampling
from tokenmill.sample.sampler import gather_logprobs, logprob_lists, sample, top_logprobs
from tokenmill.worker.step_inputs import StepInputs

# (top ids, top logprobs, chosen logprob, chosen rank) of one position
PositionLogprobs = tuple[list[int], list[float], float, int]


@dataclass
class RunnerOutput:
    # per request: its sampled token (with draft tokens: the accepted ones and the next), and
    # where asked their logprobs
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # request id -> (first prompt position scored, one entry per scored position)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    # draft heads: request id -> (draft tokens for its next step, their distributions)
    drafts: dict[str, tuple[list[int], Any]] = field(default_factory=dict)
    # a pooling model: request id -> its vector, for those whose prompt the step completed
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Launched:
    """A step whose forward has started: its logits here, or on their way (`pending`)."""

    scheduled: list[ScheduledRequest]
    inputs: StepInputs
    logits: torch.Tensor | None = None
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    pending: PendingLogits | None = None
    hidden: torch.Tensor | None = None  # every row's final hidden state (draft heads)
    pooled: list[torch.Tensor] = field(default_factory=list)  # per inputs.pool_seqs entry
    # once sampled (`sample_step`): its results but the plain rows' tokens and logprobs, and
    # those on their way to the host: (tokens, their requests' ids), (logprob parts, the ids
    # of the requests asking, how many top logprobs each)
    output: RunnerOutput | None = None
    tokens: tuple[HostCopy, list[str]] | None = None
    logprobs: tuple[tuple, list[str], list[int]] | None = None

    def results(self) -> RunnerOutput:
        """The sampled results with the plain rows' tokens and logprobs (waiting for their
        copies)."""
        out = self.output
        if self.tokens is not None:
            tokens, request_ids = self.tokens
            for rid, token in zip(request_ids, tokens.tolist()):
                out.sampled[rid] = [token]
        if self.logprobs is not None:
            parts, request_ids, ks = self.logprobs
            for rid, scored in zip(request_ids, logprob_lists(parts, ks)):
                out.logprobs[rid] = [scored]
        return out


def sample_step(launched: Launched, sampling: RequestSampling, generator: torch.Generator,
         previous: tuple[torch.Tensor, dict[str, int]] | None = None) -> torch.Tensor | None:
    """Sample the step's logits: returns the plain rows' tokens (on the device, one per
    request of `launched.tokens`; their copy to the host started); drafted rows are
    verified into `launched.output`. `previous`: the last step's tokens on the device and
    each request's row there, which the penalties of the step's decodes that ran ahead of
    them count (asynchronous scheduling)."""
    inputs, scheduled = launched.inputs, launched.scheduled
    out = launched.output = RunnerOutput()
    if launched.logits is None:
        return None
    logits = launched.logits.float()
    requests = [scheduled[i] for i in inputs.sample_seqs]
    # each sequence's last rows (1, or 1 + its drafts: speculative decoding)
    ends = list(itertools.accumulate(inputs.sample_counts))
    plain = [j for j, n in enumerate(inputs.sample_counts) if n == 1]
    token_ids = None
    if plain:
        rows = [ends[j] - 1 for j in plain]
        chosen = [requests[j].request for j in plain]
        batch = sampling.batch(chosen)
        if batch.seen_mask is not None or batch.output_counts is not None:
            pending = [(row, previous[1][requests[j].request.request_id])
                     for row, j in enumerate(plain) if requests[j].output_pending]
            if pending:
                sampling.count_in_flight(batch, pending, previous[0])
        rows_logits = logits[rows] if len(rows) < len(logits) else logits
        mask_rows(rows_logits, chosen)  # (structured outputs' rows only)
        result = sample(rows_logits, batch, generator)
        token_ids = result.token_ids
        request_ids = [r.request_id for r in chosen]
        launched.tokens = HostCopy(token_ids), request_ids
        if result.logprobs is not None:  # (read on the host with the tokens: `results`)
            asked, parts, ks = result.logprobs
            launched.logprobs = (tuple(None if p is None else HostCopy(p) for p in parts),
                                 [request_ids[i] for i in asked], ks)
    drafted = [j for j, n in enumerate(inputs.sample_counts) if n > 1]
    spans = [(ends[j] - inputs.sample_counts[j], ends[j]) for j in drafted]
    chosen = [requests[j] for j in drafted]
    for s, (a, b) in zip(chosen, spans):
        if s.request.grammar is not None:  # (structured outputs)
            mask_drafted(logits[a:b], s.request, s.drafts)
    verified = verify_many(
        logits, spans, [sampling.drafted_batch(s.request, s.drafts) for s in chosen],
        [s.drafts for s in chosen],
        [sampling.generator(s.request) or generator for s in chosen],
        [s.draft_probs for s in chosen]) if drafted else []
    for s, (a, _), tokens in zip(chosen, spans, verified):
        params, rid = s.request.sampling_params, s.request.request_id
        out.sampled[rid] = tokens
        if params.logprobs is not None:  # of each emitted token, at its row
            scored = gather_logprobs(logits[a:a + len(tokens)], torch.tensor(tokens),
                                     [params.logprobs] * len(tokens))
            out.logprobs[rid] = [scored[i] for i in range(len(tokens))]
    return token_ids


def score_prompt(s: ScheduledRequest, logits: torch.Tensor, out: RunnerOutput) -> None:
    """Logprobs of prompt tokens start+1 .. end (those this chunk's logits predict)."""
    request = s.request
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(request.prompt_token_ids[s.start + 1:s.start + 1 + len(logits)],
                           device=logits.device)
    k = request.sampling_params.prompt_logprobs
    scored = top_logprobs(logprobs, targets, [k] * len(targets))
    out.prompt_logprobs[request.request_id] = (s.start + 1, scored)
