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

from tokenmill.sample.sampler import SamplingBatch, adjusted, argmax, probabilities


def verify(logits: torch.Tensor, batch: SamplingBatch, drafts: list[int],
           generator: torch.Generator | None,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """Emitted tokens of one request from the target's logits [k + 1, V] (float32) at the
    positions after its last token and after each draft, `batch` the request's sampling
    settings for each row (penalties and bans of the context up to that row): greedy, or
    the distributions the sampler would draw from.
    `draft_probs`: the distributions the drafts were drawn from (at least k rows over the
    target's vocabulary; None: one-hot drafts, as n-gram lookup proposes)."""
    logits = adjusted(logits, batch)
    if batch.all_greedy:
        return verify_greedy(argmax(logits.contiguous()).tolist(), drafts)
    if draft_probs is not None:
        draft_probs = draft_probs[:len(drafts)]
    return verify_sampled(probabilities(logits, batch), drafts, draft_probs, generator)


def verify_many(logits: torch.Tensor, spans: list[tuple[int, int]],
                batches: list[SamplingBatch], drafts: list[list[int]],
                generators: list[torch.Generator | None],
                draft_probs: list[torch.Tensor | None]) -> list[list[int]]:
    """`verify` of several requests, each over its rows logits[a:b] (`spans`, ascending),
    with one argmax pass and one read to the host for every greedy request whose scores
    are adjusted in place (no penalties: a GPU step then waits for the device once, not once
    a request); the others one by one, as `verify` takes them."""
    out: list[list[int] | None] = [None] * len(spans)
    together = []
    for i, ((a, b), batch) in enumerate(zip(spans, batches, strict=True)):
        if not batch.all_greedy:
            out[i] = verify(logits[a:b], batch, drafts[i], generators[i], draft_probs[i])
            continue
        rows = adjusted(logits[a:b], batch)  # (bans and biases written into `logits`)
        if rows.data_ptr() == logits[a:b].data_ptr():
            together.append(i)
        else:
            out[i] = verify_greedy(argmax(rows.contiguous()).tolist(), drafts[i])
    if together:
        first, last = spans[together[0]][0], spans[together[-1]][1]
        picks = argmax(logits[first:last].contiguous()).tolist()
        for i in together:
            a, b = spans[i]
            out[i] = verify_greedy(picks[a - first:b - first], drafts[i])
    return out


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
