"""Structured outputs' masks on a step's logits: the constrained rows keep only the tokens
their grammar allows next (`mask_rows`: one bitmask row each, filled by the request's
matcher; `mask_drafted`: the rows verifying a request's drafts), each request's CPU time
noted on its grammar state (the engine ends a request whose mask is too slow). Slow
reference beside them:
`allowed_slow` tries every token on a copy of the matcher (tests)."""

from __future__ import annotations

import time
from typing import Any

import torch

from tokenmill.core.request import Request


def mask_rows(logits: torch.Tensor, requests: list[Request]) -> None:
    """Constrained rows of `logits` (row i is requests[i]'s) keep only the tokens their
    grammar allows next (the others -> -inf), in place."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None
            and r.grammar.active and not r.grammar.matcher.is_terminated()]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for j, i in enumerate(rows):
        state = requests[i].grammar
        start = time.thread_time()
        state.matcher.fill_next_token_bitmask(bitmask, j)
        state.mask_cpu_s = time.thread_time() - start  # (the engine ends a slow one)
    view = logits[rows]
    xgr.apply_token_bitmask_inplace(view, bitmask.to(logits.device))
    logits[rows] = view


def mask_drafted(logits: torch.Tensor, request: Request, drafts: list[int]) -> None:
    """The k + 1 rows verifying `drafts` of a constrained request: row i keeps what the
    grammar allows after the drafts before it (taken on its matcher, then rolled back). Past a
    draft the grammar refuses, rows repeat the mask at that draft: verification stops there
    (its row cannot choose the refused draft) and never reads them. A grammar waiting for
    the end of a reasoning section starts at the row after the drafts complete it."""
    first = request.grammar.rows_from(request.output_token_ids, drafts)
    matcher = request.grammar.matcher
    if first is None or matcher.is_terminated():
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, logits.shape[-1])  # (all allowed)
    taken, start = 0, time.thread_time()
    for i in range(first, len(drafts) + 1):
        if i == first + taken:
            matcher.fill_next_token_bitmask(bitmask, i)
            if i < len(drafts) and not matcher.is_terminated() \
                    and matcher.accept_token(drafts[i]):
                taken += 1
        else:
            bitmask[i] = bitmask[first + taken]
    matcher.rollback(taken)
    request.grammar.mask_cpu_s = time.thread_time() - start  # (the engine ends a slow one)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))


def allowed_slow(matcher: Any, vocab_size: int) -> set[int]:
    """Every token the matcher accepts next, one try each on a fork (the reference)."""
    allowed = set()
    for token in range(vocab_size):
        trial = matcher.fork()
        if trial.accept_token(token):
            allowed.add(token)
    return allowed
