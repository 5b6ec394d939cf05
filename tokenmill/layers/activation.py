"""Gated activations of the MLP over a merged gate|up projection: silu(gate) * up, and
Gemma's gelu_tanh(gate) * up (on GPUs one Triton kernel each, triton_ops.py)."""

from __future__ import annotations

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
