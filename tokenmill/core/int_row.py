"""`IntRow`: ints appended at the end of an int64 array grown by doubling, read as a view.
What a step reads every time (a request's block ids, an n-gram proposer's context) is then
a view, not a Python list converted again: O(new) a step instead of O(length). A view stays
what it was when the row grows (appends land past it, or in a new array)."""

from __future__ import annotations

import numpy as np


class IntRow:
    __slots__ = ("array", "size")

    def __init__(self, capacity: int = 16) -> None:
        self.array = np.zeros(capacity, dtype=np.int64)
        self.size = 0

    def extend(self, values: list[int]) -> None:
        end = self.size + len(values)
        if end > len(self.array):
            grown = np.zeros(max(end, 2 * len(self.array)), dtype=np.int64)
            grown[:self.size] = self.array[:self.size]
            self.array = grown
        self.array[self.size:end] = values
        self.size = end

    def view(self) -> np.ndarray:
        return self.array[:self.size]
