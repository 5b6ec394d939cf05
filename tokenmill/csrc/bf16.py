"""ctypes wrappers of bf16_panel.c: bf16 weights kept in panels of 64 output channels by
k-pairs, multiplied by fp32 activations rounded to bf16 (AVX512-BF16's `vdpbf16ps` where the
CPU has it, pairs widened to fp32 elsewhere). Re-exported by `tokenmill.csrc`."""

from __future__ import annotations

import torch

from tokenmill.csrc.build import address
from tokenmill.csrc.build import loaded as _library

__all__ = ["bf16_native", "bf16_panel_stride", "bf16_to_panels", "bf16_panel_gemm",
           "bf16_panel_glu"]


def bf16_native() -> bool:
    """Whether this build multiplies bf16 panels with AVX512-BF16 dot products (twice fp32's
    products a cycle); elsewhere the pairs are widened to fp32 (half the bytes, fp32 speed)."""
    return bool(_library().tm_bf16_native())


def bf16_panel_stride(k: int) -> int:
    """The panels' K: k rounded up to even (the last pair padded with a zero)."""
    return k + (k & 1)


def bf16_to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight (any float dtype; rounded to bf16) -> panels [ceil(N/64), KP/2, 64, 2]
    bf16, zero past N and K."""
    w = weight.detach().to(torch.bfloat16).contiguous()
    n, k = w.shape
    kp = bf16_panel_stride(k)
    panels = torch.empty(-(-n // 64), kp // 2, 64, 2, dtype=torch.bfloat16)
    _library().tm_bf16_to_panels(address(w), n, k, kp, address(panels))
    return panels


def bf16_panel_gemm(x: torch.Tensor, panels: torch.Tensor, n: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 contiguous @ the panels' weight^T (+ bias) -> [M, N] float32; x is
    rounded to bf16 first, the sums are fp32."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if _library().tm_bf16_panel_gemm(address(x), address(panels), address(bias), address(y),
                                     m, n, k, panels.shape[1] * 2):
        raise MemoryError("bf16 panel GEMM: no memory for the rounded activations")
    return y


def bf16_panel_glu(x: torch.Tensor, panels: torch.Tensor, inter: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for a merged gate|up weight of 2 * inter channels in
    panels (inter a multiple of 64) -> [M, inter], without the [M, 2 * inter] product."""
    m, k = x.shape
    act = torch.empty(m, inter, dtype=torch.float32)
    code = _library().tm_bf16_panel_glu(address(x), address(panels), address(bias),
                                        address(act), m, inter, k, panels.shape[1] * 2)
    if code == -3:
        raise ValueError(f"intermediate size {inter} is not a multiple of 64")
    if code:
        raise MemoryError("bf16 panel GEMM: no memory for the rounded activations")
    return act
