"""The per-token layer ops as single Triton kernels for GPUs, each replacing the several torch
kernels of its reference (norm.py, rotary.py, activation.py), which they follow rounding step
for rounding step: residual add + RMSNorm, rotary embedding of q and k heads together, and
the gated activations (SiLU, GELU-tanh) of a merged gate|up product. A decode step of a small
model is a chain of kernels too short to fill the GPU, so their number, not their bytes, sets
its time. Checked on the CPU under TRITON_INTERPRET=1 (tests/test_triton_ops.py)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """A module of Triton kernels, imported on first use; None without triton (a CPU-only
    install)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def kernels() -> ModuleType | None:
    return kernel_module("tokenmill.layers.triton_op_kernels")


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


SKINNY_MAX_ROWS = 16


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  setting: tuple[int, int, int] | None = None, splits: int = 1,
                  gated: bool = False) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K]^T (+ bias) for decode's few rows (rows of x and of the
    weight contiguous): narrow column blocks fill the GPU where cuBLAS's tiles leave it idle
    (F.linear is the reference). `setting` (BLOCK_N, BLOCK_K, warps): that launch (tests,
    bench/gemv_sweep.py); None: the autotuned one for the layer's shape (the first one on the
    CPU, in the interpreter). `splits` > 1 (with a setting): K ranges summed in float32 by
    atomics (measured by the sweep only). `gated`: weight = [gate | up] and the result
    silu(x @ gate^T) * (x @ up^T), [M, N / 2], as `gated(..., gelu=False)` of the product."""
    from triton import cdiv  # (present: this runs only where kernels() loaded)

    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if m == 0:
        return x.new_empty(0, n)
    block_m = 1 if m == 1 else SKINNY_MAX_ROWS
    bias_arg = bias if bias is not None else weight
    if setting is None and not x.is_cuda:  # the interpreter (tests): nothing to time
        setting = (kernels().ONE_ROW_SETTINGS if m == 1 else kernels().ROWS_SETTINGS)[0]
    if setting is None:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        kernel = kernels().skinny_one_row if m == 1 else kernels().skinny_rows
        kernel[lambda meta: (cdiv(n, meta["BLOCK_N"]), 1)](
            x, weight, bias_arg, y, m, n, k, k, x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, ATOMIC=False, GATED=gated, BLOCK_M=block_m)
        return y
    if gated and splits > 1:
        raise ValueError("a gated product cannot be split over K ranges")
    block_n, block_k, warps = setting
    per_split = cdiv(cdiv(k, splits), block_k) * block_k
    y = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if splits > 1
         else torch.empty(m, n, dtype=x.dtype, device=x.device))
    kernels().skinny_linear_kernel[(cdiv(n, block_n), cdiv(k, per_split))](
        x, weight, bias_arg, y, m, n, k, per_split, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ATOMIC=splits > 1, GATED=gated, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y.to(x.dtype) if splits > 1 else y
