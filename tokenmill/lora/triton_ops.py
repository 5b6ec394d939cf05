"""A step's adapter products on a GPU as two Triton kernels per layer (vLLM's lora_shrink and
lora_expand, the Punica grouping): the step's rows sorted by slot on the device and padded
per slot to whole row blocks (`align_rows`, once per step), then every block of one slot
multiplies its rows by that slot's A^T (shrink, into a [rows, width] buffer) and the result
by its B^T, added to the base product in place (expand). Rows of the base model fall in no
block. One launch each whatever the number of adapters; `LoRALayer.add_reference` is the
reference (tests/lora/test_lora_triton.py, in Triton's interpreter on a CPU)."""

from __future__ import annotations

from types import ModuleType

import torch

from tokenmill.layers.fused_moe import align
from tokenmill.layers.triton_ops import kernel_module

BLOCK_M = 16  # rows per program
BLOCK_R = 16  # adapter columns per step of the expand's inner loop (and per shrink program)


def kernels() -> ModuleType | None:
    return kernel_module("tokenmill.lora.triton_kernels")


def usable(x: torch.Tensor) -> bool:
    """Whether `x` (a GPU tensor, with triton installed) takes these kernels."""
    return x.is_cuda and kernels() is not None


def align_rows(slot_of_row: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each padded position, slot of each block of BLOCK_M positions; -1: a block of
    base-model rows or of padding) for `slot_of_row` [T] (-1: the base model's rows)."""
    ids = torch.where(slot_of_row < 0, num_slots, slot_of_row)
    rows, block_slot = align(ids.unsqueeze(1), num_slots + 1, BLOCK_M)
    return rows, torch.where(block_slot == num_slots, -1, block_slot)


def _precision(x: torch.Tensor) -> str:
    return ("tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
            else "ieee")


def add(x: torch.Tensor, out: torch.Tensor, at: torch.Tensor, bt: torch.Tensor,
        widths: torch.Tensor, max_width: int, rows: torch.Tensor,
        block_slot: torch.Tensor) -> torch.Tensor:
    """out[t] += (x[t] @ at[s, :, :w]) @ bt[s, :w, :N] for each row t of slot s >= 0 (w:
    widths[s]), in place. x [T, K], out [T, N]: rows with a unit column stride; at
    [slots, K, W], bt [slots, W, >= N] contiguous; (rows, block_slot) from `align_rows`."""
    t, k = x.shape
    n = out.shape[1]
    if not t or not max_width:
        return out
    tmp = torch.empty(t, max_width, dtype=x.dtype, device=x.device)
    found = kernels()
    blocks = block_slot.shape[0]
    precision = _precision(x)
    found.lora_shrink_kernel[(blocks, -(-max_width // BLOCK_R))](
        x, at, tmp, rows, block_slot, widths, t, k, x.stride(0), at.stride(0), at.stride(1),
        tmp.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=64, PRECISION=precision)
    block_n = 64
    found.lora_expand_kernel[(blocks, -(-n // block_n))](
        tmp, bt, out, rows, block_slot, widths, t, n, tmp.stride(0), bt.stride(0),
        bt.stride(1), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=BLOCK_R,
        PRECISION=precision)
    return out
