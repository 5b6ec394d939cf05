"""`choose_linear_kernels`: after loading, every `Linear` gets the fastest kernel its device,
dtype and the kernel switches allow (CPU-packed float32 panels, CPU bf16 panels, the Triton
skinny matmul)."""

from __future__ import annotations

from torch import nn

from tokenmill.config import kernels as kernel_switches
from tokenmill.layers.bf16_linear import CpuBf16Kernel
from tokenmill.layers.linear import CpuPackedKernel, DenseKernel, Linear
from tokenmill.layers.skinny import SkinnyKernel


def choose_linear_kernels(model: nn.Module, bf16_weights: bool = False) -> dict[str, int]:
    """After loading: give every `Linear` the fastest kernel its device and dtype have;
    `bf16_weights` (a float32 model on the CPU asked for in bfloat16): float layers keep
    their weights in bf16 panels. Returns how many layers got each kernel (logged by the
    loader)."""
    counts: dict[str, int] = {}
    skinny = kernel_switches.current().gpu.skinny_linear
    for module in model.modules():
        if isinstance(module, Linear):
            # (a layer whose float weight is read directly, as MLA's kv_b_proj, stays as is)
            dense = isinstance(module.kernel, DenseKernel) and not module.keep_weight
            if (dense and bf16_weights and not module.keep_float
                    and CpuBf16Kernel.supports(module)):
                module.use_kernel(CpuBf16Kernel(module))
            elif dense and CpuPackedKernel.supports(module):
                module.use_kernel(CpuPackedKernel(module))
            elif (skinny and type(module.kernel) is DenseKernel
                  and SkinnyKernel.supports(module)):
                module.kernel = SkinnyKernel()  # (reads the layer's own weight)
            counts[module.kernel.name] = counts.get(module.kernel.name, 0) + 1
    return counts
