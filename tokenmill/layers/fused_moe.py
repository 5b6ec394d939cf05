"""The experts of a mixture-of-experts block as two Triton grouped matmuls (GPUs): the
(token, expert) assignments are sorted by expert on the device and padded per expert to whole
row blocks (`align`), each program multiplies one block of rows by its expert's weights
(gate|up, then down with the routing weight applied), and each token's k rows are summed.
Nothing waits on the host, so a decode step with experts can be a CUDA graph; the per-expert
loop of layers/moe.py (`grouped_experts`) is the reference it is tested against.

Serves float, int8, int4 and float8 experts (weight-only: dequantized in registers, so
weights cross memory at 1 or 1/2 byte each) held whole or split across tensor-parallel
ranks; an expert-parallel block, GGUF blocks with offsets and int8-activation (a8w8) experts
keep the per-expert loop."""

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


class ExpertStack:
    """One projection of every expert stacked [E, ...]: float weights, or int8 / int4
    weights (quantization/linear_kernels.py's layouts) with their scales (and int4 mins), or
    float8 weights with their channel scales, run weight-only (activations stay 16-bit, as
    vLLM's fp8 Marlin path; the per-expert loop rounds them through e4m3 too), or a block-FP8
    checkpoint's float8 weights with their group scales (weight-only in the loop as well).
    The experts' layers keep views of the stacks: no second copy."""

    QUANT = {"DenseKernel": 0, "Int8Kernel": 8, "Fp8Kernel": 8, "Fp8BlockKernel": 8,
             "Int4Kernel": 4}

    def __init__(self, layers: list) -> None:
        kernel = layers[0].kernel
        self.quant = self.QUANT[type(kernel).__name__]
        self.scale = self.min = self._read = None
        if self.quant == 0:
            self.w = torch.stack([layer.weight.detach() for layer in layers])
            for i, layer in enumerate(layers):
                layer.weight.data = self.w[i]
            self.k = self.group = self.w.shape[2]
            return
        if type(kernel).__name__ == "Fp8Kernel":  # (one scale per channel, or per tensor)
            self.w = torch.stack([layer.kernel.qweight for layer in layers])
            self.scale = torch.stack([layer.kernel.scale.reshape(-1, 1).expand(
                self.w.shape[1], 1) for layer in layers]).contiguous()
            for i, layer in enumerate(layers):
                layer.kernel.qweight = layer.kernel.tensors["qweight"] = self.w[i]
            self.k = self.group = self.w.shape[2]
            return
        names = ["qweight", "scale"] + (["min"] if self.quant == 4 else [])
        stacks = {name: torch.stack([layer.kernel.tensors[name] for layer in layers])
                  for name in names}
        for i, layer in enumerate(layers):
            layer.kernel.tensors = {name: stack[i] for name, stack in stacks.items()}
        self.w, self.scale, self.min = stacks["qweight"], stacks["scale"], stacks.get("min")
        self.group = kernel.group
        self.k = self.scale.shape[2] * self.group

    @classmethod
    def servable(cls, layers: list) -> bool:
        """Same kernel type throughout, no biases; quantized: one group size, a multiple of
        32, no per-group offsets. (CPU panels, which only the forced tests meet, are unpacked
        into the stacks.)"""
        kernel = layers[0].kernel
        name = type(kernel).__name__
        if name not in cls.QUANT or any(type(layer.kernel) is not type(kernel)
                                         or layer.bias is not None for layer in layers):
            return False
        if name == "DenseKernel":
            return all(layer.weight is not None for layer in layers)
        if name == "Fp8Kernel":
            return kernel.qweight.shape[1] % 32 == 0
        return kernel.group % 32 == 0 and all(
            getattr(layer.kernel, "offset", None) is None and layer.kernel.group == kernel.group
            for layer in layers)

    @property
    def out_features(self) -> int:
        return self.w.shape[1]

    def read(self) -> tuple[torch.Tensor, int]:
        """The weights as the kernel reads them and its QUANT code: float8 natively or as
        bytes (quantization/triton_kernels.py), decided at the first call."""
        if self._read is None:
            w, quant = self.w, self.quant
            if w.dtype == torch.float8_e4m3fn:
                from tokenmill.quantization import triton_kernels as tk

                mode = tk.fp8_mode(w.device)
                w, quant = tk.fp8_weights(w, mode), 9 if mode == tk.FP8_BYTES else 8
            self._read = w, quant
        return self._read


def grouped_matmul(a: torch.Tensor, w: ExpertStack, slots: torch.Tensor,
                   block_expert: torch.Tensor, rows: int, a_per_slot: int,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[s] = a[s // a_per_slot] @ w[expert of s]^T (times weights[s]) for every slot s <
    rows: [rows, N]."""
    out = torch.zeros(rows, w.out_features, dtype=a.dtype, device=a.device)
    kernels = triton_ops.kernels()
    block_n = 64
    grid = (block_expert.shape[0], -(-w.out_features // block_n))
    scale = w.scale if w.scale is not None else w.w
    weights_read, quant = w.read()
    kernels.grouped_matmul_kernel[grid](
        a, weights_read, scale, w.min if w.min is not None else scale, out, slots, block_expert,
        weights if weights is not None else a, rows, a_per_slot, w.out_features, w.k,
        w.k // w.group, w.group, a.stride(0), w.w.stride(0), w.w.stride(1),
        scale.stride(0), out.stride(0), QUANT=quant, HAS_WEIGHTS=weights is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=32,
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
    return out


class FusedExperts:
    """The stacked weights of a block's experts and the fused forward."""

    def __init__(self, experts: nn.ModuleList) -> None:
        self.w13 = ExpertStack([e.gate_up_proj for e in experts])
        self.w2 = ExpertStack([e.down_proj for e in experts])
        self.gelu = type(experts[0].act).__name__ == "GeluTanhAndMul"

    @staticmethod
    def servable(experts: nn.ModuleList) -> bool:
        """Experts of one servable kind (float, int8, int4 or float8 weights), one gated
        activation, all here."""
        from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul

        layers = [(getattr(e, "gate_up_proj", None), getattr(e, "down_proj", None))
                  for e in experts]
        if any(layer is None for pair in layers for layer in pair):
            return False
        if any(type(e.act) not in (SiluAndMul, GeluTanhAndMul)
               or type(e.act) is not type(experts[0].act) for e in experts):
            return False
        return all(ExpertStack.servable([pair[i] for pair in layers]) for i in (0, 1))

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                 ) -> torch.Tensor:
        t, k = ids.shape
        slots, block_expert = align(ids, self.w13.w.shape[0])
        rows = t * k
        h = grouped_matmul(x, self.w13, slots, block_expert, rows, k)
        act = triton_ops.gated(h, self.gelu)
        out = grouped_matmul(act, self.w2, slots, block_expert, rows, 1,
                             weights.reshape(-1).float())
        return out.view(t, k, -1).sum(dim=1)
