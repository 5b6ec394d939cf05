"""Decode's linears on GPUs through the Triton skinny matmul (layers/triton_ops.py) where it
beats cuBLAS: with TOKENMILL_GPU_SKINNY_LINEAR=1 (config.GpuKernelSettings) every 16-bit
`Linear` on a GPU gets `SkinnyKernel`, which for a step of up to 16 rows times both kernels
once per (row count, layer shape) in CUDA graphs, as decode steps run, and keeps the faster;
cuBLAS (F.linear) stays the reference and serves every larger step. On an H200 cuBLAS spent
22.6 us per layer of a 0.5B model's batch-1 decode for 7 us worth of weight bytes: its tiles
leave most of the card idle on 896-1152 outputs (bench/results/README.md, 2026-11-27)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.layers import triton_ops
from tokenmill.layers.linear import DenseKernel, Linear

logger = logging.getLogger(__name__)

# (device, rows, weight shape, dtype, bias, gated) -> whether the skinny kernel is faster
_FASTER: dict[tuple, bool] = {}


def prefer_skinny(key: tuple, capturing: bool,
                  timings: Callable[[], tuple[float, float]]) -> bool:
    """The cached choice for `key`, else `timings()` = (skinny, cuBLAS) compared once and
    kept. While a CUDA graph is captured nothing can be timed: cuBLAS, not kept (the graphs'
    eager warm-up pass makes the first call of each shape). A kernel that fails here (an old
    card, a Triton without the feature): cuBLAS, kept, logged."""
    if key in _FASTER:
        return _FASTER[key]
    if capturing:
        return False
    try:
        mine, theirs = timings()
    except Exception as exc:  # noqa: BLE001 - any failure leaves the layer on cuBLAS
        logger.warning("The Triton skinny matmul failed on %s (%s); cuBLAS serves it.",
                       key[2:], type(exc).__name__)
        mine, theirs = 1.0, 0.0
    _FASTER[key] = mine < theirs
    return _FASTER[key]


def _faster(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            gated: bool) -> bool:
    if not x.is_cuda:  # Triton's interpreter (tests): nothing to time, the kernel runs
        return True
    from triton.testing import do_bench_cudagraph

    def cublas() -> torch.Tensor:
        out = F.linear(x, weight, bias)
        return triton_ops.gated(out, gelu=False) if gated else out

    def timings() -> tuple[float, float]:
        torch.cuda.synchronize(x.device)  # (x may still be written on another stream)
        return (do_bench_cudagraph(lambda: triton_ops.skinny_linear(x, weight, bias,
                                                                    gated=gated), rep=10),
                do_bench_cudagraph(cublas, rep=10))

    key = (x.device, x.shape[0], tuple(weight.shape), weight.dtype, bias is not None, gated)
    return prefer_skinny(key, torch.cuda.is_current_stream_capturing(), timings)


class SkinnyKernel(DenseKernel):
    """16-bit weights on a GPU: steps of up to 16 rows through the skinny matmul where it
    was timed faster for that row count and shape, the rest through F.linear."""

    name = "triton-skinny"

    def __init__(self) -> None:
        # this layer's choices by (rows, gated): read on every eager call, so kept here
        # rather than looked up by the shape's whole key each time
        self._chosen: dict[tuple[int, bool], bool] = {}

    @staticmethod
    def supports(layer: Linear) -> bool:
        w = layer.weight
        return (w is not None and w.device.type == "cuda" and w.stride(-1) == 1
                and w.dtype in (torch.float16, torch.bfloat16) and triton_ops.usable(w))

    def _takes(self, layer: Linear, x: torch.Tensor, gated: bool) -> bool:
        if not (x.dim() == 2 and x.shape[0] <= triton_ops.SKINNY_MAX_ROWS
                and x.stride(-1) == 1 and x.dtype == layer.weight.dtype):
            return False
        chosen = self._chosen.get((x.shape[0], gated))
        if chosen is None:
            chosen = _faster(x, layer.weight, layer.bias, gated)
            if not x.is_cuda or not torch.cuda.is_current_stream_capturing():
                self._chosen[x.shape[0], gated] = chosen  # (a capture's answer is not kept)
        return chosen

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._takes(layer, x, False):
            return triton_ops.skinny_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def apply_gated(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a merged gate|up layer in the same launch as its product (the
        gated kernel's launch and the [M, 2I] product saved) where that was timed faster
        than both; None otherwise (the caller runs them apart)."""
        if layer.out_features % 2 or not self._takes(layer, x, True):
            return None
        return triton_ops.skinny_linear(x, layer.weight, layer.bias, gated=True)
