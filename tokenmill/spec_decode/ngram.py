"""Prompt lookup (vLLM's "ngram" method; the seed's `inference_with_reference`): for n from
prompt_lookup_max down to prompt_lookup_min, find the latest earlier place where the
context's last n tokens occur, and propose the (up to k) tokens that followed them there.
Free to compute, and right where the output copies from its context (code edits, quoting,
extraction, repetitive formats)."""

from __future__ import annotations

import numpy as np

from tokenmill.core.int_row import IntRow


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
    """One request's tokens as an `IntRow`, extended by the tokens it lacks at each step:
    building the array from the token lists again each step cost O(length)."""

    def __init__(self) -> None:
        self.row = IntRow(256)

    def update(self, prompt: list[int], output: list[int]) -> np.ndarray:
        """The request's tokens now (prompt then output) as an array view."""
        row, head = self.row, len(prompt)
        have = row.size
        if len(prompt) + len(output) < have or have and row.array[have - 1] != (
                prompt[have - 1] if have <= head else output[have - 1 - head]):
            row.size = 0  # (not what this array holds: start again)
        if row.size < head:
            row.extend(prompt[row.size:])
        row.extend(output[row.size - head:])
        return row.view()


def propose_slow(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same, one position at a time (the reference `propose` is tested against)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
