"""The low-rank products of a step's adapters added to a linear layer's output: the base
product once for every row, then per adapter in the step one shrink (x @ A^T) and one expand
(@ B^T) over that adapter's rows, gathered and scattered by index (the S-LoRA / Punica
grouping: csrc/lora.c on a CPU in float32, lora/triton_ops.py's kernels on a GPU, torch ops
elsewhere and as their reference). Adapters sit in a fixed number of slots per layer."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill import csrc
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.lora import triton_ops
from tokenmill.lora.adapter import LoRAWeights


class LoRABatch:
    """Which rows of the step run which slot: set once per step by the runner, read by every
    layer. A layer may see the step's rows in consecutive chunks (a CPU prompt's MLP): each
    layer keeps its own cursor."""

    def __init__(self) -> None:
        self.num_rows = 0
        self.slot_of_row = np.zeros(0, dtype=np.int64)
        self.active = False  # some row of the step has an adapter
        self._groups: list[tuple[int, slice | torch.Tensor]] | None = []
        self._aligned: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._device = torch.device("cpu")

    def set(self, slot_of_row: np.ndarray, device: torch.device) -> None:
        """`slot_of_row`: the slot of each row of the step, -1 for the base model's rows."""
        self.num_rows = len(slot_of_row)
        self.slot_of_row, self._device = slot_of_row, device
        self.active = bool((slot_of_row >= 0).any())
        self._groups = None  # (made when the torch path asks: the C kernel takes the slots)
        self._aligned = {}

    @property
    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, its rows) for the slots of the step's rows: a slice where the rows are one
        run, else their indices on the device."""
        if self._groups is None:
            self._groups = self._grouped(self.slot_of_row)
        return self._groups

    def clear(self) -> None:
        self.set(np.zeros(0, dtype=np.int64), self._device)

    def _grouped(self, slots: np.ndarray) -> list[tuple[int, slice | torch.Tensor]]:
        groups = []
        for slot in np.unique(slots):
            if slot < 0:
                continue
            rows = np.flatnonzero(slots == slot)
            if rows[-1] - rows[0] + 1 == len(rows):  # (one run of rows: a view, no gather)
                groups.append((int(slot), slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                groups.append((int(slot), torch.from_numpy(rows).to(self._device)))
        return groups

    def slots_tensor(self, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count)'s slots as an int64 tensor (host memory)."""
        return torch.from_numpy(np.ascontiguousarray(self.slot_of_row[start:start + count]))

    def aligned(self, start: int, count: int, num_slots: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [start, start + count) sorted by slot in blocks on the device, for the
        Triton kernels (`triton_ops.align_rows`): made once per step and chunk."""
        key = (start, count, num_slots)
        if key not in self._aligned:
            slots = torch.from_numpy(np.ascontiguousarray(self.slot_of_row[start:start + count]))
            self._aligned[key] = triton_ops.align_rows(slots.to(self._device), num_slots)
        return self._aligned[key]

    def groups_for(self, start: int, count: int) -> list[tuple[int, slice | torch.Tensor]]:
        """The groups of rows [start, start + count) of the step, numbered from 0."""
        if start == 0 and count == self.num_rows:
            return self.groups
        return self._grouped(self.slot_of_row[start:start + count])


class LoRALayer:
    """`max_loras` slots of one linear layer's adapters, for a layer of P projections
    (q|k|v: 3, gate|up: 2, else 1) and an adapter of rank r at this layer: A transposed, at
    [slots, in, P * R], projection i's A^T in columns i * r .. i * r + r, and B transposed,
    bt [slots, P * R, out], projection i's B^T in the same rows and in its own output columns
    (zeros elsewhere). On a CPU in float32 csrc/lora.c adds the products (without the
    zeros), on a GPU lora/triton_ops.py's two kernels; elsewhere, and as their reference,
    `add_reference`'s two matmuls."""

    def __init__(self, layer: Linear, batch: LoRABatch, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.batch = batch
        sizes = layer.output_sizes if isinstance(layer, MergedLinear) else [layer.out_features]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.width = len(sizes) * max_rank
        self.at = torch.zeros(max_loras, layer.in_features, self.width, dtype=dtype,
                              device=device)
        self.offsets_t = torch.tensor(self.offsets, dtype=torch.int64)
        self.fast = csrc.usable(self.at)
        self.triton = not self.fast and triton_ops.usable(self.at)
        # (rows padded off multiples of 1 KiB: see csrc/lora.c)
        out = layer.out_features
        self.bt = torch.zeros(max_loras, self.width, out + (16 if out % 256 == 0 else 0),
                              dtype=dtype, device=device)
        self.widths = [0] * max_loras  # per slot: A's rows in use (0: no adapter here)
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)  # per slot: r (0: none)
        self.widths_t = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self._at = 0  # where this layer's next chunk of the step's rows starts

    @torch.inference_mode()  # (the slots were made in a step's inference mode)
    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        self.at[slot].zero_()
        self.bt[slot].zero_()
        self.widths[slot] = 0
        self.ranks[slot] = 0
        self.widths_t[slot] = 0
        if weights is None:
            return
        r = max(a.shape[0] for a, _ in weights.pairs.values())
        for shard, (a, b) in weights.pairs.items():
            i = shard or 0
            self.at[slot, :, i * r:i * r + a.shape[0]].copy_(a.T)
            rows = b.shape[0]
            self.bt[slot, i * r:i * r + b.shape[1],
                    self.offsets[i]:self.offsets[i] + rows].copy_(b.T)
        self.widths[slot] = (len(self.offsets) - 1) * r
        self.ranks[slot] = r
        self.widths_t[slot] = self.widths[slot]

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base product) plus each row's adapter product, in place."""
        n, batch = x.shape[0], self.batch
        if not batch.active or x.dim() != 2:
            return out
        start = 0 if n == batch.num_rows else self._at
        self._at = (start + n) % batch.num_rows if n != batch.num_rows else 0
        if self.fast and x.is_contiguous() and out.is_contiguous():
            csrc.lora_add(x, out, self.at, self.bt, len(self.offsets) - 1, self.offsets_t,
                          self.ranks, batch.slots_tensor(start, n))
            return out
        if self.triton and x.stride(-1) == 1 and out.stride(-1) == 1:
            rows, block_slot = batch.aligned(start, n, self.at.shape[0])
            return triton_ops.add(x, out, self.at, self.bt, self.widths_t, max(self.widths),
                                  rows, block_slot)
        return self.add_reference(x, out, batch.groups_for(start, n))

    def add_reference(self, x: torch.Tensor, out: torch.Tensor,
                      groups: list[tuple[int, slice | torch.Tensor]]) -> torch.Tensor:
        """The products as two matmuls per adapter over its rows, gathered and scattered."""
        for slot, rows in groups:
            width = self.widths[slot]
            if not width:
                continue
            delta = ((x[rows] @ self.at[slot, :, :width])
                     @ self.bt[slot, :width, :out.shape[1]])
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out


class EmbeddingLoRA:
    """`max_loras` slots of the token embedding's adapters (PEFT's lora_embedding_A / _B):
    A^T [slots, vocabulary rows on this rank, R], a token's row of it that token's low-rank
    code, and B^T [slots, R, hidden] with the scale folded in. A row of the step adds
    A^T[slot, token] @ B^T[slot]: a row gather and one small matmul per adapter, in torch
    ops on any device (the lookup's cost, not a layer's)."""

    def __init__(self, layer: VocabParallelEmbedding, batch: LoRABatch, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.batch = batch
        hidden = layer.weight.shape[1] if layer.weight is not None else layer.head.in_features
        self.at = torch.zeros(max_loras, layer.rows, max_rank, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, max_rank, hidden, dtype=dtype, device=device)
        self.widths = [0] * max_loras

    @torch.inference_mode()
    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        self.at[slot].zero_()
        self.bt[slot].zero_()
        self.widths[slot] = 0
        if weights is None:
            return
        a, b = weights.pairs[None]
        self.at[slot, :, :a.shape[0]].copy_(a.T)
        self.bt[slot, :a.shape[0]].copy_(b.T)
        self.widths[slot] = a.shape[0]

    def add(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the looked-up rows of `ids`, this rank's token numbers) plus each row's
        adapter product, in place. Lookups of other rows than the step's (a draft head's)
        are the base model's."""
        batch = self.batch
        if not batch.active or ids.numel() != batch.num_rows:
            return out
        flat, rows_out = ids.reshape(-1), out.view(-1, out.shape[-1])
        for slot, rows in batch.groups:
            width = self.widths[slot]
            if not width:
                continue
            delta = self.at[slot, flat[rows], :width] @ self.bt[slot, :width]
            if isinstance(rows, slice):
                rows_out[rows] += delta
            else:
                rows_out.index_add_(0, rows, delta)
        return out
