"""RMSNorm with an optional fused residual add, numerically HF's formula (the compiled CPU
kernel rounds the same products; only the order of the sum of squares can differ); on GPUs
one Triton kernel (triton_ops.py); LayerNorm with the same call; RMSNorm over a projection
tensor-parallel ranks split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import csrc
from tokenmill.layers import triton_ops
from tokenmill.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    # what a checkpoint's weight is short of ours (Gemma's (1 + w) norms hold 1 + w: 1.0);
    # a checkpoint tokenmill writes stores the checkpoint's value
    checkpoint_offset = 0.0

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


class LayerNorm(nn.Module):
    """LayerNorm with a bias (Phi-2, Starcoder2), with RMSNorm's optional fused residual
    add; torch's own kernel, as transformers'."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.bias = (nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias
                     else None)
        if bias:
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        x = x + residual
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps), x


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a whole projection whose rows tensor-parallel ranks split (OLMo 2's q
    and k norms: over every head at once): each rank holds `rows` of the weight from
    `start`, and the mean of squares is all-reduced. Ranks holding the same rows (key/value
    heads shared by several ranks) each add theirs, so the total counts every row as often
    as the `rows * tp` it is divided by."""

    def __init__(self, start: int, rows: int, eps: float, tp) -> None:
        super().__init__(rows, eps)
        self.tp = tp
        self.weight.weight_loader = lambda param, loaded: default_weight_loader(
            param, loaded.narrow(0, start, rows))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.tp.size == 1:
            return super().forward(x, residual)
        if residual is not None:
            raise ValueError("ShardedRMSNorm takes no residual.")
        dtype = x.dtype
        x = x.float()
        squares = x.pow(2).sum(-1, keepdim=True)
        mean = self.tp.all_reduce(squares) / (x.shape[-1] * self.tp.size)
        return self.weight * (x * torch.rsqrt(mean + self.eps)).to(dtype)


class L2Norm(nn.Module):
    """x / rms(x) without a weight (Llama 4's q/k norm), in float32 as transformers'."""

    def __init__(self, hidden_size: int = 0, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
