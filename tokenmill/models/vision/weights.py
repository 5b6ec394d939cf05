"""An image side's checkpoint tensors into its parameters: each tensor named by the
encoder's own mapping (None: not one it runs), shapes checked, every parameter required."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def load_named(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
               param_name: Callable[[str], str | None],
               reshape: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """`param_name(checkpoint name)`: the parameter of `module` it fills; `reshape(ours,
    tensor)`: a tensor stored in another shape than ours (a convolution run as a linear)."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        ours = param_name(name)
        if ours is None:
            continue
        if reshape is not None:
            tensor = reshape(ours, tensor)
        if ours not in params or params[ours].shape != tensor.shape:
            raise ValueError(f"Checkpoint tensor {name!r} matches no vision parameter.")
        with torch.no_grad():
            params[ours].copy_(tensor)
        loaded.add(ours)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"The checkpoint lacks vision weights: {', '.join(sorted(missing))}.")
