"""`Fp4Experts`: a mixture-of-experts block's MXFP4 experts (gpt-oss', as `Mxfp4Kernel` keeps
them on CPUs with AVX-512 VNNI) run as one compiled call a step (csrc/fp4_experts.c): both
products of every active expert, the clamped SwiGLU and the weighted sum, without the torch
calls between the products that the per-expert loop (layers/moe.py's `grouped_experts`, the
reference it is tested against) makes for each expert."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import csrc
from tokenmill.layers.moe import SparseMoE, grouped_experts
from tokenmill.quantization.linear_kernels import PartsKernel
from tokenmill.quantization.mxfp4 import Mxfp4Kernel


def _fp4(kernel) -> bool:
    return isinstance(kernel, Mxfp4Kernel) and kernel.fp4


def _gate_and_up(layer) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None:
    """A gate|up layer's two halves as (panels, panel scales, bias) each, or None where they
    are not fp4 panels of equal size."""
    kernel, bias = layer.kernel, layer.bias
    halves = bias.chunk(2) if bias is not None else (None, None)
    if _fp4(kernel) and layer.out_features % 32 == 0:
        panels = layer.out_features // 32  # (16 channels a panel, half of them a half)
        wp, sp = kernel.panels
        return [(wp[:panels], sp[:panels], halves[0]), (wp[panels:], sp[panels:], halves[1])]
    if (isinstance(kernel, PartsKernel) and len(kernel.parts) == 2
            and kernel.sizes[0] == kernel.sizes[1] and kernel.sizes[0] % 16 == 0
            and all(_fp4(part) for part in kernel.parts)):
        return [(*part.panels, half) for part, half in zip(kernel.parts, halves)]
    return None


class Fp4Experts(nn.Module):
    """What `SparseMoE.fused` calls (x, weights, ids) -> the experts' weighted sum, for a
    block whose experts are all held here (no expert parallel), with fp4 gate|up and down
    panels and gpt-oss' clamped SwiGLU (`swiglu_clamp`); float32 rows only, others through
    the per-expert loop."""

    host_sync = True  # (the kernel reads the routing on the host)

    def __init__(self, moe: SparseMoE, parts: torch.Tensor, keep: list[torch.Tensor],
                 intermediate: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.experts = [moe.experts]  # (a list: not registered as this module's children)
        self.parts, self.keep = parts, keep
        self.intermediate, self.alpha, self.limit = intermediate, alpha, limit

    @classmethod
    def of(cls, moe: SparseMoE) -> Fp4Experts | None:
        """The block's experts as one call, or None where it does not take them."""
        if (not csrc.available() or moe.expert_parallel or moe.router == "sigmoid_top_k"
                or moe.fused is not None):
            return None
        rows, keep, shape = [], [], None
        for expert in moe.experts:
            clamp = getattr(getattr(expert, "act", None), "swiglu_clamp", None)
            gate_up = _gate_and_up(expert.gate_up_proj) if clamp is not None else None
            down = expert.down_proj
            if gate_up is None or not _fp4(down.kernel):
                return None
            pieces = [*gate_up, (*down.kernel.panels, down.bias)]
            ours = (clamp, down.in_features, down.out_features)
            if shape not in (None, ours) or ours[1] % 32 or ours[2] % 32:
                return None
            shape = ours
            rows.append([csrc.address(t) or 0 for piece in pieces for t in piece])
            keep += [t for piece in pieces for t in piece if t is not None]
        (alpha, limit), intermediate, _ = shape
        return cls(moe, torch.tensor(rows, dtype=torch.int64), keep, intermediate,
                   float(alpha), float(limit))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return grouped_experts(x, weights, ids, self.experts[0])
        return csrc.fp4_experts(x.contiguous(), ids.contiguous(),
                                weights.float().contiguous(), self.parts, self.intermediate,
                                self.alpha, self.limit)
