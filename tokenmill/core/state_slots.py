"""`StateSlots`: the recurrent-state slots of a model with state layers (Mamba-2's SSM, the
gated DeltaNet of Qwen3-Next), one per running request, beside its KV blocks.

A state layer keeps, per request, a fixed-size state (its convolution's last inputs and its
recurrent state) instead of one row per token: the slot is taken with the request's first
blocks, kept while it runs (its prompt chunks carry the state from one step to the next),
and given back with its blocks when it finishes or is preempted (a preempted request
recomputes from its first token, as its KV blocks do). Slot ids are the same on every layer
and rank (the runner's state tensors: worker/state_cache.py)."""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}.")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # (pops the lowest first)
        self._slots: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def get(self, request_id: str) -> int:
        """The request's slot; -1 when it holds none."""
        return self._slots.get(request_id, -1)

    def take(self, request_id: str) -> bool:
        """A slot for the request (the one it holds, else a free one); False when none is
        free (nothing changes then)."""
        if request_id in self._slots:
            return True
        if not self._free:
            return False
        self._slots[request_id] = self._free.pop()
        return True

    def free(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
