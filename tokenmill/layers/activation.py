"""Gated activations of the MLP over a merged gate|up projection: silu(gate) * up, and
Gemma's gelu_tanh(gate) * up (on GPUs one Triton kernel each, triton_ops.py); any other
named activation (a config's `hidden_act`), gated or not."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import csrc
from tokenmill.layers import triton_ops


def _triton(x: torch.Tensor) -> bool:
    return triton_ops.usable(x) and x.dim() == 2 and x.stride(-1) == 1


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if csrc.usable(x) and x.is_contiguous() and x.dim() == 2:
            return csrc.silu_and_mul(x)
        if _triton(x):
            return triton_ops.gated(x, gelu=False)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, approximate="tanh") * up (transformers' `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _triton(x):
            return triton_ops.gated(x, gelu=True)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# transformers' `hidden_act` names -> the function (gelu_new is the tanh approximation)
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names, refused by name when unknown."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: "
                         f"{', '.join(sorted(_ACTIVATIONS))}.")
    return _ACTIVATIONS[name]


class GatedActivation(nn.Module):
    """act(gate) * up for an activation without a fused kernel (Gemma's exact GELU)."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


def gated_activation(name: str) -> nn.Module:
    """The gated activation module for a config's `hidden_act`."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return GeluTanhAndMul()
    return GatedActivation(activation(name))
