"""RMSNorm with an optional fused residual add, numerically HF's formula (the compiled CPU
kernel rounds the same products; only the order of the sum of squares can differ); on GPUs
one Triton kernel (triton_ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import csrc
from tokenmill.layers import triton_ops
from tokenmill.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual); the sum may
        be stored in `residual`'s memory (the caller passes a residual it owns)."""
        if (csrc.usable(x) and x.is_contiguous()
                and (residual is None or residual.is_contiguous())):
            out = csrc.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if (triton_ops.usable(x) and x.dim() == 2 and x.stride(-1) == 1
                and (residual is None or residual.stride(-1) == 1)):
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
