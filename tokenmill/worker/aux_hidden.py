"""EAGLE-3's aux hidden states: the inputs (hidden + residual) of the target layers its head
reads, kept each step by forward pre-hooks the draft heads install on those layers — the
model's forward knows nothing of them. Graphs hand theirs back with `put`."""

from __future__ import annotations

import functools

import torch
from torch import nn


class AuxHiddenStates:
    def __init__(self, layers: nn.ModuleList, ids: tuple[int, ...]) -> None:
        """Keep the inputs of `layers[i]` for each i of `ids` this stage holds (ascending)."""
        self.ids = tuple(ids)
        self.hidden: dict[int, torch.Tensor] = {}
        for i in self.ids:
            layers[i].register_forward_pre_hook(functools.partial(self._keep, i))

    def _keep(self, i: int, module: nn.Module, args: tuple) -> None:
        _, hidden, residual = args[:3]  # (a decoder layer's rope, hidden, residual, ...)
        self.hidden[i] = hidden if residual is None else hidden + residual

    def of_step(self) -> list[torch.Tensor]:
        """The states the last forward kept, in `ids` order."""
        return [self.hidden[i] for i in self.ids]

    def put(self, tensors: list[torch.Tensor]) -> None:
        """A step's states where a graph replay, not the hooks, produced them."""
        self.hidden = dict(zip(self.ids, tensors, strict=True))
