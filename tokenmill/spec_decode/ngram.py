"""Prompt lookup (vLLM's "ngram" method; the seed's `inference_with_reference`): for n from
prompt_lookup_max down to prompt_lookup_min, find the latest earlier place where the
context's last n tokens occur, and propose the (up to k) tokens that followed them there.
Free to compute, and right where the output copies from its context (code edits, quoting,
extraction, repetitive formats)."""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for the context `tokens` (prompt and output so far); [] when no
    suffix of min_n .. max_n tokens occurred before. Vectorized: the places whose token is
    the context's last (one comparison over the context), narrowed token by token backwards
    to those whose n tokens end like the context: tens of microseconds at 32k tokens, where
    comparing every n-token window took milliseconds."""
    context = np.asarray(tokens, dtype=np.int64)
    size = len(context)
    if size < 2:
        return []
    # ends of earlier windows (each followed by at least one token) on the last token
    ends = np.flatnonzero(context[:size - 1] == context[size - 1])
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):
            if not len(found):
                break
            found = found[context[found - back] == context[size - 1 - back]]
        if len(found):
            start = int(found[-1]) + 1
            return context[start:start + k].tolist()
    return []


class Context:
    """One request's tokens as a growing int64 array (capacity doubled), extended by the
    tokens it lacks at each step: building the array from the token lists again each step
    cost O(length)."""

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)
        self.size = 0

    def update(self, prompt: list[int], output: list[int]) -> np.ndarray:
        """The request's tokens now (prompt then output) as an array view."""
        total, head = len(prompt) + len(output), len(prompt)
        if total < self.size or self.size and self.array[self.size - 1] != (
                prompt[self.size - 1] if self.size <= head else output[self.size - 1 - head]):
            self.size = 0  # (not what this array holds: start again)
        if total > len(self.array):
            grown = np.empty(max(total, 2 * len(self.array)), dtype=np.int64)
            grown[:self.size] = self.array[:self.size]
            self.array = grown
        if self.size < head:
            self.array[self.size:head] = prompt[self.size:]
            self.size = head
        self.array[self.size:total] = output[self.size - head:]
        self.size = total
        return self.array[:total]


def propose_slow(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same, one position at a time (the reference `propose` is tested against)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
