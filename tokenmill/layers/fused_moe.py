"""The experts of a mixture-of-experts block as two Triton grouped matmuls (GPUs): the
(token, expert) assignments are sorted by expert on the device and padded per expert to whole
row blocks (`align`), each program multiplies one block of rows by its expert's weights
(gate|up, then down with the routing weight applied), and each token's k rows are summed.
Nothing waits on the host, so a decode step with experts can be a CUDA graph; the per-expert
loop of layers/moe.py (`grouped_experts`) is the reference it is tested against.

Serves float experts (the dense kernel) held whole or split across tensor-parallel ranks; an
expert-parallel block or quantized experts keep the per-expert loop."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import triton_ops

BLOCK_M = 16  # rows (token, expert assignments) per program


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [P], expert of each block [P / block_m]): the flat assignments (token t's j-th
    expert is slot t * k + j) sorted by expert, tokens in order within one, each expert's run
    padded to a multiple of block_m with the slot count (past every row); blocks past the
    last expert's get expert -1. P is the fixed bound T * k + E * (block_m - 1), rounded up:
    no size depends on the routing."""
    flat = ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    total = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    # (not bincount: on a GPU it reads the largest id back to the host, breaking a graph)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    dest = (ends - padded)[expert] + torch.arange(n, device=dev) - first_of_expert[expert]
    slots = torch.full((total,), n, dtype=torch.int64, device=dev)
    slots[dest] = order
    block_start = torch.arange(0, total, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return slots, block_expert


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, slots: torch.Tensor,
                   block_expert: torch.Tensor, rows: int, a_per_slot: int,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[s] = a[s // a_per_slot] @ w[expert of s]^T (times weights[s]) for every slot s <
    rows: [rows, N]."""
    out = torch.zeros(rows, w.shape[1], dtype=a.dtype, device=a.device)
    kernels = triton_ops.kernels()
    n, k = w.shape[1], w.shape[2]
    block_n = 64
    grid = (block_expert.shape[0], -(-n // block_n))
    kernels.grouped_matmul_kernel[grid](
        a, w, out, slots, block_expert, weights if weights is not None else a, rows,
        a_per_slot, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        HAS_WEIGHTS=weights is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=32,
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
    return out


class FusedExperts:
    """The stacked weights of a block's experts (the experts' own weights become views of
    them: no second copy) and the fused forward."""

    def __init__(self, experts: nn.ModuleList) -> None:
        self.w13 = torch.stack([e.gate_up_proj.weight.detach() for e in experts])
        self.w2 = torch.stack([e.down_proj.weight.detach() for e in experts])
        for i, e in enumerate(experts):
            e.gate_up_proj.weight.data = self.w13[i]
            e.down_proj.weight.data = self.w2[i]
        self.gelu = type(experts[0].act).__name__ == "GeluTanhAndMul"

    @staticmethod
    def servable(experts: nn.ModuleList) -> bool:
        """Float experts of the dense kernel, no biases, one gated activation, all here."""
        from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul
        from tokenmill.layers.linear import DenseKernel

        for e in experts:
            layers = (getattr(e, "gate_up_proj", None), getattr(e, "down_proj", None))
            if any(layer is None or type(layer.kernel) is not DenseKernel
                   or layer.weight is None or layer.bias is not None for layer in layers):
                return False
            if type(e.act) not in (SiluAndMul, GeluTanhAndMul) or type(e.act) is not type(
                    experts[0].act):
                return False
        return True

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                 ) -> torch.Tensor:
        t, k = ids.shape
        slots, block_expert = align(ids, self.w13.shape[0])
        rows = t * k
        h = grouped_matmul(x, self.w13, slots, block_expert, rows, k)
        act = triton_ops.gated(h, self.gelu)
        out = grouped_matmul(act, self.w2, slots, block_expert, rows, 1,
                             weights.reshape(-1).float())
        return out.view(t, k, -1).sum(dim=1)
