"""bf16 weights on the CPU: `--dtype bfloat16` there keeps every float linear layer's weight
in bf16 panels (csrc/bf16_panel.c) while the model computes in float32 — half the bytes a
decode step streams, and on CPUs with AVX512-BF16 twice the products a cycle of fp32 FMAs.
llama.cpp runs a BF16 file the same way (fp32 activations, bf16 dot products)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import csrc
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.linear import Linear


class CpuBf16Kernel:
    """A linear layer's weight rounded to bf16 once, in panels; x rounded to bf16 per call,
    sums in fp32. `reference` is the slow formula it must equal within fp32 rounding."""

    name = "cpu-bf16"
    ANY_ROWS = 2**31 - 1  # the fastest kernel at every row count (LinearForm.max_rows)

    def __init__(self, layer: Linear) -> None:
        self.out_features, self.in_features = layer.weight.shape
        self.panels = csrc.bf16_to_panels(layer.weight)

    @staticmethod
    def supports(layer: Linear) -> bool:
        w = layer.weight
        return (w is not None and not w.is_meta and w.device.type == "cpu"
                and w.dtype in (torch.float32, torch.bfloat16) and csrc.available())

    @staticmethod
    def reference(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """What the kernel computes, the slow way: both operands rounded to bf16, products
        and sums in float64, then float32."""
        b = None if bias is None else bias.double()
        return F.linear(x.to(torch.bfloat16).double(), weight.to(torch.bfloat16).double(),
                        b).float()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        y = csrc.bf16_panel_gemm(rows, self.panels, self.out_features, layer.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def apply_gated(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a merged gate|up layer in one pass (as CpuPackedKernel's)."""
        inter = self.out_features // 2
        if x.dim() != 2 or x.dtype != torch.float32 or inter % 64 or self.out_features % 2:
            return None
        return csrc.bf16_panel_glu(x.contiguous(), self.panels, inter, layer.bias)

    def compiled_form(self) -> csrc.LinearForm:
        return csrc.LinearForm(csrc.BF16_PANEL, self.panels.shape[1] * 2, self.ANY_ROWS,
                               self.panels.data_ptr())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` of the weight (a tied embedding's lookups in its LM head)."""
        ids = ids.reshape(-1)
        picked = self.panels[ids // 64, :, ids % 64, :]  # [n, KP/2, 2]
        return picked.reshape(len(ids), -1)[:, :self.in_features].float()

    def weight_bytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def store_in_bf16(model: nn.Module) -> None:
    """Before loading: every float linear's own weight and every embedding table becomes an
    (empty) bf16 parameter, so the checkpoint loads straight into bf16 — no float32 copy of
    the whole model on the way; a table's lookups give float32 rows. A tensor shared (a
    tied LM head and its table) is replaced for every module holding it. Weights read
    directly (MLA's kv_b_proj), kept in float (a router) or held by anything else (a norm)
    stay float32."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter) and not w.is_meta and w.dtype == torch.float32:
            holders.setdefault(id(w), []).append(module)

    def bf16_ready(module: nn.Module) -> bool:
        if isinstance(module, Linear):
            return not (module.keep_weight or module.keep_float)
        return isinstance(module, VocabParallelEmbedding)

    for modules in holders.values():
        if not all(bf16_ready(m) for m in modules):
            continue
        w = modules[0].weight
        stored = nn.Parameter(torch.empty(w.shape, dtype=torch.bfloat16, device=w.device),
                              requires_grad=False)
        for name, value in vars(w).items():  # (weight_loader and the like)
            setattr(stored, name, value)
        for module in modules:
            module.weight = stored
            if isinstance(module, VocabParallelEmbedding):
                module.out_dtype = torch.float32


def tied_tables(model: nn.Module) -> list[tuple[VocabParallelEmbedding, Linear]]:
    """(table, LM head) pairs sharing one weight, found before the kernels replace it."""
    tables = {id(m.weight): m for m in model.modules()
              if isinstance(m, VocabParallelEmbedding) and m.weight is not None}
    return [(tables[id(m.weight)], m) for m in model.modules()
            if isinstance(m, Linear) and m.weight is not None and id(m.weight) in tables]


def look_up_in_panels(pairs: list[tuple[VocabParallelEmbedding, Linear]]) -> None:
    """After the kernel choice: a table tied to a head with bf16 panels reads its rows there
    (the same bf16 values) and drops its own copy."""
    for table, head in pairs:
        if isinstance(head.kernel, CpuBf16Kernel):
            table.share_rows(head)
