"""Prompt lookup (vLLM's "ngram" method; the seed's `inference_with_reference`): for n from
prompt_lookup_max down to prompt_lookup_min, find the latest earlier place where the
context's last n tokens occur, and propose the (up to k) tokens that followed them there.
Free to compute, and right where the output copies from its context (code edits, quoting,
extraction, repetitive formats)."""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for the context `tokens` (prompt and output so far); [] when no
    suffix of min_n .. max_n tokens occurred before. Vectorized: one comparison of every
    window of the context with the suffix per n."""
    context = np.asarray(tokens, dtype=np.int64)
    size = len(context)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = context[size - n:]
        # windows starting at 0 .. size - n - 1: every occurrence before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(context[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return context[start:start + k].tolist()
    return []


def propose_slow(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same, one position at a time (the reference `propose` is tested against)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
