"""Which decoder layers this pipeline stage holds (vLLM's `make_layers`): the stage's own
built, the others' left as weightless placeholders, so a model's layer list keeps its
indices on every stage."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tokenmill.distributed.parallel_state import get_world


class OtherStageLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no weights here."""


def make_layers(num_layers: int, make: Callable[[int], nn.Module],
                head_cost: float = 0.0) -> tuple[range, nn.ModuleList]:
    """(this stage's layer indices, all `num_layers` layers: `make(i)` for those, an
    `OtherStageLayer` for the rest); `head_cost`: the LM head's weight in layers (the last
    stage's share is smaller by it)."""
    held = get_world().layers(num_layers, head_cost)
    return held, nn.ModuleList(make(i) if i in held else OtherStageLayer()
                               for i in range(num_layers))
