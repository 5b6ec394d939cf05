"""One batched sampler for every request in a step, each row with its own settings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill import csrc
from tokenmill.host_to_device import on_device


@dataclass
class SamplingBatch:
    """Per-row sampling settings for the rows of a logits matrix, built by the model runner."""

    temperature: torch.Tensor  # [N] float; 0 = greedy
    top_p: torch.Tensor | None = None  # [N] float, None when no row uses it
    top_k: torch.Tensor | None = None  # [N] int64, 0 = off; None when no row uses it
    min_p: torch.Tensor | None = None  # [N] float
    repetition_penalty: torch.Tensor | None = None  # [N], with seen_mask
    frequency_penalty: torch.Tensor | None = None  # [N], with output_counts
    presence_penalty: torch.Tensor | None = None  # [N], with output_counts
    seen_mask: torch.Tensor | None = None  # [N, V] bool: token occurs in prompt or output
    output_counts: torch.Tensor | None = None  # [N, V] float: occurrences in the output
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, ids) min_tokens
    bias: list[tuple[int, list[int], list[float]]] = field(default_factory=list)  # logit_bias
    allowed: list[tuple[int, list[int]]] = field(default_factory=list)  # allowed_token_ids
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded rows
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, None = not asked
    # every row greedy: known on the host from the requests' settings (the runner passes it;
    # reading it back from `temperature` would wait for the device)
    all_greedy: bool | None = None

    def __post_init__(self) -> None:
        if self.all_greedy is None:
            self.all_greedy = bool((self.temperature == 0).all())


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [N]
    # the rows asking for logprobs, still on the device (`logprob_rows`; `logprob_lists`
    # lists them on the host); None when no row asks
    logprobs: tuple[list[int], tuple, list[int]] | None


def banned_by_bad_words(output_ids: list[int], words: list[list[int]]) -> list[int]:
    """Next tokens that would complete a bad word: its last token, when the output already
    ends with the rest of it."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or output_ids[len(output_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.repetition_penalty is not None:
        # A penalty near 0 (float32 rounds 5e-324 to 0, and -inf * 0 is NaN) is taken as the
        # smallest normal float; the scores it divides past float range stop where dividing
        # by the smallest temperature (1e-5) stays finite, so softmax makes no NaNs of them.
        finfo = torch.finfo(logits.dtype)
        penalty = batch.repetition_penalty.clamp(min=finfo.tiny).unsqueeze(1)
        top = finfo.max * 1e-5
        scaled = torch.where(logits > 0, (logits / penalty).clamp(max=top), logits * penalty)
        logits = torch.where(batch.seen_mask, scaled, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty.unsqueeze(1) * batch.output_counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty.unsqueeze(1) * (batch.output_counts > 0)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k / nucleus / min-p set."""
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if batch.top_k is None and batch.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.top_k is not None:
        k = torch.where(batch.top_k > 0, batch.top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        remove |= ranks >= k.unsqueeze(1)
    if batch.top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # Keep the smallest set whose mass reaches top_p: drop a token when the mass before
        # it already reaches top_p (the most likely token is always kept).
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= batch.top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each row's sampling distribution: its temperature, then top-k / top-p / min-p."""
    temperature = batch.temperature.clamp(min=1e-5).unsqueeze(1)
    return torch.softmax(apply_top_k_top_p_min_p(logits / temperature, batch), dim=-1)


def adjusted(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The scores each row draws from before temperature: penalties applied, logit_bias
    added, tokens outside allowed_token_ids and banned tokens (min_tokens, bad words) out (in
    place when no penalty applies)."""
    logits = apply_penalties(logits, batch)
    for row, ids, values in batch.bias:
        logits[row, ids] += on_device(values, logits.dtype, logits.device)
    for row, ids in batch.allowed:
        index = on_device(ids, torch.int64, logits.device)
        kept = logits[row].index_select(0, index)
        logits[row] = float("-inf")
        logits[row].index_copy_(0, index, kept)
    for row, ids in batch.banned:
        logits[row, ids] = float("-inf")
    return logits


def draw(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row of `adjusted` scores (greedy rows take the argmax), and the
    distributions the sampling rows drew from (None when every row is greedy)."""
    greedy = argmax(logits)
    if batch.all_greedy:
        return greedy, None
    probs = probabilities(logits, batch)
    # Inverse CDF: one uniform per row, the first token whose cumulative mass passes it. Seeded
    # rows use their own generator, so their draws don't depend on which batch they land in.
    uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
    for row, gen in batch.generators.items():
        uniform[row] = torch.rand(1, generator=gen, device=probs.device)
    sampled = inverse_cdf(probs, uniform)
    return torch.where(batch.temperature == 0, greedy, sampled), probs


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds uniform[i] x the row's
    total (a zero-probability token never is). One uniform and one running sum per row: the
    exponential race (argmax p / E, E ~ Exp(1)) drew a random number and a log per vocabulary
    entry, ~8 % of a served CPU step with 20 sampled rows of a 49k vocabulary."""
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    # uniform x total can round up to the total itself: past the end, the likeliest token
    return torch.where(picked < probs.shape[1], picked, probs.argmax(dim=-1))


def sample(logits: torch.Tensor, batch: SamplingBatch,
           generator: torch.Generator | None = None) -> SampleResult:
    """logits [N, V] float32 -> one token per row (greedy rows take the argmax)."""
    token_ids, _ = draw(adjusted(logits, batch), batch, generator)
    return SampleResult(token_ids, logprob_rows(logits, token_ids, batch.num_logprobs))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the compiled kernel on CPU float32 (torch's reduction over a
    large vocabulary costs ~1 % of a decode step), else torch."""
    if (logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
            and csrc.usable(logits)):
        return csrc.argmax_rows(logits)
    return logits.argmax(dim=-1)


def logprob_rows(logits: torch.Tensor, token_ids: torch.Tensor,
                 num_logprobs: list[int | None]) -> tuple[list[int], tuple, list[int]] | None:
    """The rows asking for logprobs, their `logprob_parts` (on the device) and how many top
    logprobs each asks; None when no row asks."""
    rows = [i for i, n in enumerate(num_logprobs) if n is not None]
    if not rows:
        return None
    ks = [num_logprobs[r] for r in rows]
    logprobs = torch.log_softmax(logits[rows], dim=-1)
    return rows, logprob_parts(logprobs, token_ids[rows], max(ks)), ks


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_logprobs: list[int | None]) -> dict:
    """Row -> (top ids, top logprobs, chosen logprob, rank) of the rows asking, on the host."""
    asked = logprob_rows(logits, token_ids, num_logprobs)
    if asked is None:
        return {}
    rows, parts, ks = asked
    return dict(zip(rows, logprob_lists(parts, ks)))


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                 ks: list[int]) -> list[tuple[list[int], list[float], float, int]]:
    """For each row: top-k ids and logprobs, the chosen token's logprob and its rank (1-based)."""
    return logprob_lists(logprob_parts(logprobs, chosen, max(ks)), ks)


def logprob_parts(logprobs: torch.Tensor, chosen: torch.Tensor, k_max: int) -> tuple:
    """`top_logprobs` on the device: each row's top-`k_max` ids and logprobs (None for 0),
    the chosen token's logprob and its rank."""
    chosen_lp = logprobs.gather(1, chosen.to(logprobs.device).unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
    top_vals, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    return top_ids, top_vals, chosen_lp, ranks


def logprob_lists(parts: tuple, ks: list[int]) -> list[tuple[list[int], list[float], float, int]]:
    """`logprob_parts` as host lists, row i's top `ks[i]` (the parts: tensors, or anything
    with a `tolist()` such as their copies on the way to the host)."""
    top_ids, top_vals, chosen_lp, ranks = (None if p is None else p.tolist() for p in parts)
    return [(top_ids[i][:k] if k else [], top_vals[i][:k] if k else [], chosen_lp[i], ranks[i])
            for i, k in enumerate(ks)]
