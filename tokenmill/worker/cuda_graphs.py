"""Uniform steps as CUDA graphs: a forward over steps whose every sequence computes `q` query
rows (decodes: q = 1; decodes carrying k draft tokens each: q = 1 + k) is captured once per
batch-size bucket and q over static input buffers and replayed, so a step costs one graph
launch instead of a Python pass issuing ~40 kernels per layer. `StepGraphs` holds the
buffers, buckets and captures; `DecodeGraphs` the target model's steps (embedding to logits);
draft_head_graphs.py the draft heads' passes.

A step of n sequences runs in the smallest bucket >= n; sequences n.. are padding: token 0 at
positions 0 .. q - 1, cache slot -1 (the Triton K/V write skips it: nothing of a real
sequence is touched) and q keys of block 0 to attend (read, never written). Only the
attention backend that takes its metadata from tensors alone (attention/triton) can be
captured. A bucket may hold a few variants of its launches (the backend's `graph_variant`:
the Triton backend splits long sequences' keys over several programs, which short ones do
not need), each its own graph.

Without capture (`capture=False`: the CPU tests) the same buckets and padding run eagerly, so
the bucketing is checked where no GPU is."""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.host_to_device import on_device
from tokenmill.worker.aux_hidden import AuxHiddenStates
from tokenmill.worker.step_inputs import StepInputs

MAX_CAPTURED = 256  # largest batch captured (larger decode batches run eagerly)


def up_to(sizes, top: int) -> list[int]:
    """The bucket `sizes` below `top`, and `top`."""
    return [s for s in sizes if s < top] + [top]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, then every multiple of 16, up to max_num_seqs (and it)."""
    return up_to([1, 2, 4, 8, *range(16, MAX_CAPTURED + 1, 16)], min(max_num_seqs, MAX_CAPTURED))


class StepGraphs(abc.ABC):
    """Static buffers of uniform steps and their graphs, keyed (bucket, q, variant). A
    subclass's `forward(n, q, variant)` computes a bucket's outputs (a tuple of tensors) from
    the buffers and `meta(n, q, variant)`."""

    def __init__(self, backend: AttentionBackend, device: torch.device, block_size: int,
                 max_model_len: int, widths: dict[int, list[int]]) -> None:
        """`widths`: q -> the bucket sizes captured for it; `backend`: a graph-safe one (its
        `graph_step` gives the metadata a replay reads from the static buffers)."""
        self.backend, self.device, self.block_size = backend, device, block_size
        self.widths, self.max_len = widths, max_model_len
        top = max(sizes[-1] for sizes in widths.values())
        rows = max(q * sizes[-1] for q, sizes in widths.items())
        # ids, positions and slots of each row, and each sequence's length (row 3's first
        # entries): one buffer, refilled by one copy
        self.buffers = torch.tensor([[0] * rows, [0] * rows, [-1] * rows, [1] * rows],
                                    device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.buffers
        self.block_table = torch.zeros(top, -(-max_model_len // block_size), dtype=torch.int64,
                                       device=device)
        self.q_starts = {q: torch.arange(0, (sizes[-1] + 1) * q, q, dtype=torch.int32,
                                         device=device) for q, sizes in widths.items()}
        # the backend's launch variants captured per bucket: the one for short sequences and
        # the one for the longest a replay may hold (one where they agree)
        self.variants = {(n, q): sorted({backend.graph_variant(n, 1, q),
                                         backend.graph_variant(n, max_model_len, q)})
                         for q, sizes in widths.items() for n in sizes}
        self.graphs: dict[tuple[int, int, int], Any] = {}  # (bucket, q, variant) -> graph
        self.outputs: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    @abc.abstractmethod
    def forward(self, n: int, q: int, variant: int) -> tuple[torch.Tensor, ...]:
        """Bucket n's outputs for q rows a sequence, as launch `variant`."""

    def meta(self, n: int, q: int, variant: int) -> AttentionMetadata:
        """The attention metadata of bucket n's first n * q rows."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n * q],
            query_start_loc=list(range(0, (n + 1) * q, q)), context_lens=[0] * n,
            seq_lens=self.seq_lens[:n], block_table=self.block_table[:n],
            num_decodes=n if q == 1 else 0, block_size=self.block_size,
            backend_data=self.backend.graph_step(self.q_starts[q][:n + 1], variant, q))

    def capture_all(self, pool=None):
        """Capture every bucket (the largest first: the others reuse its memory) in `pool`
        (another StepGraphs' memory, or None); returns the pool."""
        for n, q in sorted(self.variants, key=lambda key: -key[0] * key[1]):
            # (captured over padding: every row's keys in range)
            self.buffers[:, :n * q].copy_(torch.from_numpy(self._host_rows(n, q, 0)))
            for variant in self.variants[n, q]:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # compiles the kernels, outside any capture
                    self.forward(n, q, variant)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[n, q, variant] = self.forward(n, q, variant)
                pool = graph.pool()
                self.graphs[n, q, variant] = graph
        torch.cuda.synchronize(self.device)
        return pool

    @property
    def sizes(self) -> list[int]:
        """The buckets of one-row steps (decodes)."""
        return self.widths.get(1, [])

    def bucket(self, n: int, q: int = 1) -> int | None:
        return next((s for s in self.widths.get(q, ()) if s >= n), None)

    def variant(self, size: int, longest: int, q: int = 1) -> int:
        """The captured variant of bucket `size` for sequences of up to `longest` keys: the
        backend's choice, else the one captured for the longest (it serves every length)."""
        choice = self.backend.graph_variant(size, longest, q)
        captured = self.variants[size, q]
        return choice if choice in captured else captured[-1]

    def fits(self, n: int, q: int, ends: list[int], block_ids) -> bool:
        """Whether n sequences of q rows ending at `ends` have a bucket and fit its table."""
        return (self.bucket(n, q) is not None and max(ends) <= self.max_len
                and max(len(b) for b in block_ids) <= self.block_table.shape[1])

    def bucket_rows(self, inputs: StepInputs) -> int:
        """A uniform step's rows a sequence (`uniform_rows`) if it has a bucket here, else 0."""
        q = inputs.uniform_rows
        fits = q in self.widths and self.fits(len(inputs.starts), q, inputs.ends,
                                              inputs.block_ids)
        return q if fits else 0

    def load(self, q: int, step: StepInputs) -> tuple[int, int]:
        """Fill the buffers with `step`'s n sequences of q rows (its tokens, positions,
        slots, lengths and block table; padding sequences after them); returns its
        (bucket, variant)."""
        n = len(step.ends)
        size = self.bucket(n, q)
        positions, slots, table = step.layout(self.block_size, size)
        rows = self._host_rows(size, q, n)
        rows[:3, :n * q] = step.token_ids, positions, slots
        rows[3, :n] = step.ends
        self.buffers[:, :size * q].copy_(on_device(rows, torch.int64, self.device))
        self.block_table[:size, :table.shape[1]].copy_(torch.from_numpy(table[:size]),
                                                       non_blocking=True)
        return size, self.variant(size, max(step.ends), q)

    @staticmethod
    def _host_rows(size: int, q: int, n: int) -> np.ndarray:
        """The buffers' rows of bucket `size` on the host, sequences n.. as padding: token 0
        at positions 0 .. q - 1, written nowhere (slot -1), q keys read."""
        rows = np.empty((4, size * q), dtype=np.int64)
        rows[:3, n * q:] = [[0], [-1], [-1]]
        rows[1, n * q:] = np.tile(np.arange(q), size - n)
        rows[3] = q
        return rows

    def replay(self, size: int, q: int, variant: int) -> tuple[torch.Tensor, ...]:
        """The bucket's outputs for the loaded step (views of its static outputs on a GPU:
        read them before the next replay)."""
        graph = self.graphs.get((size, q, variant))
        if graph is None:  # (not captured: the CPU tests)
            return self.forward(size, q, variant)
        graph.replay()
        return self.outputs[size, q, variant]


class DecodeGraphs(StepGraphs):
    """The target model's decode steps (q = 1), and with speculative decoding its steps of
    decodes carrying `drafts` tokens each (q = 1 + drafts, buckets up to `drafted_seqs`
    sequences: speculation is off above its `disable_by_batch_size`). Outputs: logits and
    what draft heads read: the final hidden states (MTP, EAGLE-1), or the hidden states
    entering the layers an EAGLE-3 head reads (`aux`, kept by hooks: worker/aux_hidden.py)."""

    def __init__(self, model: Any, backend: AttentionBackend, device: torch.device,
                 block_size: int, max_num_seqs: int, max_model_len: int, capture: bool,
                 drafts: int = 0, drafted_seqs: int = 0,
                 aux: AuxHiddenStates | None = None) -> None:
        widths = {1: capture_sizes(max_num_seqs)}
        if drafts and drafted_seqs:
            widths[1 + drafts] = capture_sizes(min(max_num_seqs, drafted_seqs))
        super().__init__(backend, device, block_size, max_model_len, widths)
        self.model = model
        self.aux = aux  # (EAGLE-3: the states its head reads, kept by hooks)
        self.pool = self.capture_all() if capture else None

    def forward(self, n: int, q: int, variant: int) -> tuple[torch.Tensor, ...]:
        hidden = self.model(self.input_ids[:n * q], self.positions[:n * q],
                            self.meta(n, q, variant))
        aux = self.aux.of_step() if self.aux is not None else []
        return self.model.compute_logits(hidden), *(aux or [hidden])

    def run(self, inputs: StepInputs, fill=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [n * q, vocab] of a uniform step of n sequences (`bucket_rows`), and what draft
        heads read of its rows: [final hidden states], or the aux layers' input states
        (ascending). `fill`: writes tokens still on the device into the step's input ids
        (asynchronous scheduling: step_paths.pending_fill)."""
        n, q = len(inputs.starts), inputs.uniform_rows
        size, variant = self.load(q, inputs)
        if fill is not None:
            fill(self.input_ids[:n])
        logits, *hidden_states = self.replay(size, q, variant)  # (logits None on ranks but 0)
        return (None if logits is None else logits[:n * q]), [x[:n * q] for x in hidden_states]
