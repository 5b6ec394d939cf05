"""Verifying draft tokens against the target model's scores of the same positions.

A request with drafts d_1 .. d_k is scored at k + 1 positions: row j holds the target's
distribution p_j for the token after d_1 .. d_j (row 0: after the committed tokens). Its
emitted tokens are the accepted drafts, then one token of the target's own:

- greedy: d_j is accepted while it equals argmax p_{j-1}; the first row that disagrees
  gives its argmax instead, and if every draft is accepted the last row's argmax follows.
  The output is exactly what decoding one token at a time would give.
- sampling (Leviathan et al., 2023): d_j, drawn by the proposer from q_{j-1}, is accepted
  with probability min(1, p(d_j) / q(d_j)); at the first rejection a token is drawn from
  max(0, p - q) renormalized, and if every draft is accepted one more is drawn from the last
  row. Each emitted token is then distributed as the target's own sample would be. A proposer
  without a distribution (n-gram lookup) proposes deterministically: q is one-hot on d_j.

Draws come from the request's generator when it has a seed, in a fixed order (k uniforms,
then one categorical), so a seeded request reproduces."""

from __future__ import annotations

import torch

from tokenmill.layers.sampler import SamplingBatch, apply_top_k_top_p_min_p, argmax
from tokenmill.sampling_params import SamplingParams


def verify(logits: torch.Tensor, params: SamplingParams, drafts: list[int],
           generator: torch.Generator | None) -> list[int]:
    """Emitted tokens of one request from the target's logits [k + 1, V] (float32) at the
    positions after its last token and after each draft: greedy, or the target's
    distribution at the request's temperature, top-k, top-p and min-p (the proposers here
    have no distribution: one-hot drafts)."""
    if params.temperature == 0:
        return verify_greedy(argmax(logits.contiguous()).tolist(), drafts)
    n, dev = len(logits), logits.device

    def column(value, neutral, dtype=torch.float32):
        return None if value == neutral else torch.full((n,), value, dtype=dtype, device=dev)

    batch = SamplingBatch(temperature=torch.full((n,), params.temperature, device=dev),
                          top_p=column(params.top_p, 1.0),
                          top_k=column(params.top_k, 0, torch.int64),
                          min_p=column(params.min_p, 0.0))
    scaled = apply_top_k_top_p_min_p(logits / max(params.temperature, 1e-5), batch)
    return verify_sampled(torch.softmax(scaled, dim=-1), drafts, None, generator)


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """Emitted tokens of one request: `target_argmax` has len(drafts) + 1 entries."""
    out = []
    for j, draft in enumerate(drafts):
        out.append(target_argmax[j])
        if target_argmax[j] != draft:
            return out
    out.append(target_argmax[len(drafts)])
    return out


def verify_sampled(probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None = None) -> list[int]:
    """Emitted tokens of one request: `probs` [k + 1, V] the target's distributions (after
    temperature, top-k / top-p / min-p), `draft_probs` [k, V] the proposer's (None:
    one-hot on each draft)."""
    k = len(drafts)
    uniform = torch.rand(k, generator=generator, device=probs.device, dtype=torch.float64)
    out = []
    for j, draft in enumerate(drafts):
        p = probs[j].double()
        q = _one_hot(draft, p) if draft_probs is None else draft_probs[j].double()
        if uniform[j] * q[draft] <= p[draft] and p[draft] > 0:  # accept: u < p / q
            out.append(draft)
            continue
        residual = (p - q).clamp(min=0)
        if residual.sum() <= 0:  # p == q on the support: cannot happen after a rejection
            residual = p
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[k].double(), generator))
    return out


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))
