"""Gated activations of the MLP over a merged gate|up projection: silu(gate) * up, and
Gemma's gelu_tanh(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import csrc


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if csrc.usable(x) and x.is_contiguous() and x.dim() == 2:
            return csrc.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, approximate="tanh") * up (transformers' `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
