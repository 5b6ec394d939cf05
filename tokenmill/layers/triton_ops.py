"""The per-token layer ops as single Triton kernels for GPUs, each replacing the several torch
kernels of its reference (norm.py, rotary.py, activation.py), which they follow rounding step
for rounding step: residual add + RMSNorm, rotary embedding of q and k heads together, and
the gated activations (SiLU, GELU-tanh) of a merged gate|up product. A decode step of a small
model is a chain of kernels too short to fill the GPU, so their number, not their bytes, sets
its time. Checked on the CPU under TRITON_INTERPRET=1 (tests/test_triton_ops.py)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


@functools.cache
def kernels() -> ModuleType | None:
    try:
        from tokenmill.layers import triton_op_kernels
    except ImportError:  # no triton (a CPU-only install)
        return None
    return triton_op_kernels


def usable(x: torch.Tensor) -> bool:
    """Whether `x` (a GPU tensor, with triton installed) takes these kernels."""
    return x.is_cuda and kernels() is not None


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float):
    """RMSNorm.forward: norm(x), or with `residual` (x + residual stored there) the pair
    (norm(x + residual), residual). x, residual: 2-D with contiguous rows."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    res = residual if residual is not None else x
    if x.shape[0]:
        kernels().add_rms_norm_kernel[(x.shape[0],)](
            x, res, weight, out, n, eps, x.stride(0), res.stride(0), out.stride(0),
            HAS_RES=residual is not None, BLOCK=_next_power_of_2(n))
    return out if residual is None else (out, residual)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """StepRotary's product: x [T, H, D] (rows of D contiguous) rotated by each token's
    position; a new contiguous tensor."""
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        kernels().rotary_kernel[(t, h)](x, cos, signed_sin, positions, out, x.stride(0),
                                         x.stride(1), cos.stride(0), d, d // 2,
                                         BLOCK=_next_power_of_2(d))
    return out


def gated(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up of x = [gate | up] (2-D, rows contiguous): SiLU, or GELU-tanh."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, _next_power_of_2(n))
    if x.shape[0]:
        kernels().gated_kernel[(x.shape[0], -(-n // block))](
            x, out, n, x.stride(0), out.stride(0), GELU=gelu, BLOCK=block)
    return out
