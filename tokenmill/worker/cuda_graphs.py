"""Decode steps as CUDA graphs: the forward of an all-decode batch (embedding to logits) is
captured once per batch-size bucket over static input buffers and replayed, so a step costs
one graph launch instead of a Python pass issuing ~40 kernels per layer.

A step of n decodes runs in the smallest bucket >= n; rows n.. are padding: token 0 at
position 0, cache slot -1 (the Triton K/V write skips it: nothing of a real sequence is
touched) and one key of block 0 to attend (read, never written). Only the attention backend
that takes its metadata from tensors alone (attention/triton) can be captured. A bucket may
hold a few variants of its launches (the backend's `graph_variant`: the Triton backend splits
long sequences' keys over several programs, which short ones do not need), each its own graph.

Without capture (`capture=False`: the CPU tests) the same buckets and padding run eagerly, so
the bucketing is checked where no GPU is."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.host_to_device import on_device
from tokenmill.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURED = 256  # largest batch captured (larger decode batches run eagerly)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, then every multiple of 16, up to max_num_seqs (and it)."""
    top = min(max_num_seqs, MAX_CAPTURED)
    sizes = [s for s in [1, 2, 4, 8, *range(16, MAX_CAPTURED + 1, 16)] if s <= top]
    return sizes if top in sizes else sizes + [top]


class DecodeGraphs:
    def __init__(self, model: Any, backend: AttentionBackend, device: torch.device,
                 block_size: int, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """`backend`: a graph-safe one (its `graph_step` gives the metadata a replay reads
        from the static buffers)."""
        self.model, self.backend, self.device = model, backend, device
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.max_len = max_model_len
        top = self.sizes[-1]
        width = -(-max_model_len // block_size)
        # ids, positions, slots and lengths of each row: one buffer, refilled by one copy
        self.rows = torch.tensor([[0] * top, [0] * top, [-1] * top, [1] * top], device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.rows
        self.block_table = torch.zeros(top, width, dtype=torch.int64, device=device)
        self.q_start = torch.arange(top + 1, dtype=torch.int32, device=device)
        # the backend's launch variants captured per bucket: the one for short sequences and
        # the one for the longest a replay may hold (one where they agree)
        self.variants = {n: sorted({backend.graph_variant(n, 1),
                                    backend.graph_variant(n, max_model_len)})
                         for n in self.sizes}
        self.capture = capture
        self.graphs: dict[tuple[int, int], Any] = {}  # (bucket, variant) -> graph
        # (bucket, variant) -> its outputs: logits, and the final hidden states (draft heads)
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def _forward(self, n: int, variant: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], query_start_loc=list(range(n + 1)),
            context_lens=[0] * n, seq_lens=self.seq_lens[:n], block_table=self.block_table[:n],
            num_decodes=n, block_size=self.block_size,
            backend_data=self.backend.graph_step(self.q_start[:n + 1], variant))
        hidden = self.model(self.input_ids[:n], self.positions[:n], meta)
        return self.model.compute_logits(hidden), hidden

    def _capture_all(self) -> None:
        pool = None
        for n in reversed(self.sizes):  # the largest first: the others reuse its memory
            for variant in self.variants[n]:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # compiles the kernels, outside any capture
                    self._forward(n, variant)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[n, variant] = self._forward(n, variant)
                pool = graph.pool()
                self.graphs[n, variant] = graph
        torch.cuda.synchronize(self.device)

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def variant(self, size: int, longest: int) -> int:
        """The captured variant of bucket `size` for sequences of up to `longest` keys: the
        backend's choice, else the one captured for the longest (it serves every length)."""
        choice = self.backend.graph_variant(size, longest)
        captured = self.variants[size]
        return choice if choice in captured else captured[-1]

    def takes(self, inputs: StepInputs) -> bool:
        return (inputs.plain_decode and self.bucket(len(inputs.starts)) is not None
                and max(inputs.ends) <= self.max_len
                and max(len(b) for b in inputs.block_ids) <= self.block_table.shape[1])

    def run(self, inputs: StepInputs, fill=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] and final hidden states [n, hidden] (what MTP / EAGLE heads
        read) of a plain decode step of n sequences (views of the bucket's outputs: read them
        before the next step). `fill`: writes tokens still on the device into the step's
        input ids (asynchronous scheduling: ModelRunner._fill)."""
        n = len(inputs.starts)
        size = self.bucket(n)
        positions, slots, table = inputs.layout(self.block_size, size)
        # padding rows: token 0 at position 0, written nowhere (slot -1), one key read
        rows = np.zeros((4, size), dtype=np.int64)
        rows[:, :n] = inputs.token_ids, positions, slots, inputs.ends
        rows[2:, n:] = [[-1], [1]]
        self.rows[:, :size].copy_(on_device(rows, torch.int64, self.device))
        if fill is not None:
            fill(self.input_ids[:n])
        self.block_table[:size, :table.shape[1]].copy_(torch.from_numpy(table),
                                                       non_blocking=True)
        variant = self.variant(size, max(inputs.ends))
        if self.capture:
            self.graphs[size, variant].replay()
            logits, hidden = self.outputs[size, variant]
        else:
            logits, hidden = self._forward(size, variant)
        return logits[:n], hidden[:n]
