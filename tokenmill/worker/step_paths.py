"""The ways one rank computes a step's final hidden states, each declaring the steps it takes;
the model runner tries them in order and runs the first that takes the step. (Decode graphs,
cuda_graphs.py, run a uniform step all the way to its logits and are asked before these.)

- `PiecewisePath`: steps of up to the largest bucket of token rows, as piecewise CUDA graphs
  between eager attention calls (piecewise_graphs.py), none of them with a LoRA adapter;
- `CompiledCpuPath`: all-decode steps of up to `max_rows` sequences on the CPU, every layer in
  one compiled call (cpu_decode_step.py; LoRA adapters' products in it too, csrc/lora.c);
- `EagerPath`: any step, op by op through the model, the reference of the others (the one
  for steps with image rows, or an image's M-RoPE positions); where
  nothing reads the other rows (and no row has a LoRA adapter: lora/layers.py maps every row
  of the step), only the sampled ones go past the last layer's K/V projection."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LogitsRows,
    leading_decodes,
)
from tokenmill.host_to_device import on_device
from tokenmill.worker.step_inputs import StepInputs


def device_inputs(inputs: StepInputs, block_size: int, device: torch.device,
                  backend: AttentionBackend, state_rows_per_slot: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step's (input ids, positions, attention metadata) on the device, the backend's
    per-step metadata prepared (`state_rows_per_slot`: worker/state_cache.py's)."""
    packed, parts, table = inputs.staged(block_size)
    # the host's numbers to the device in two copies that do not wait for it
    staged = on_device(packed, torch.int64, device)
    input_ids, positions, slots, seq_lens = (staged[part] for part in parts)
    query_start_loc = [0, *itertools.accumulate(
        end - start for start, end in zip(inputs.starts, inputs.ends))]
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=query_start_loc,
        context_lens=list(inputs.starts),
        seq_lens=seq_lens,
        block_table=on_device(table, torch.int64, device),
        num_decodes=leading_decodes(inputs.starts, inputs.ends),
        block_size=block_size,
        bidirectional=[tuple(span) for span in inputs.bidirectional],
    )
    if inputs.state_slots:  # (a slot's rows: its state and, verifying drafts, one a draft)
        slots = np.asarray(inputs.state_slots, dtype=np.int64) * state_rows_per_slot
        meta.state_slots = on_device(slots, torch.int64, device)
        if inputs.state_rows:
            meta.state_reads = on_device(slots + inputs.state_rows, torch.int64, device)
        if inputs.num_sampled_rows > len(inputs.sample_seqs):
            meta.state_drafts = [0] * len(inputs.starts)
            for i, count in zip(inputs.sample_seqs, inputs.sample_counts):
                meta.state_drafts[i] = count - 1
    backend.prepare(meta)
    if len(inputs.rope_positions):  # M-RoPE: the rows' three rotary positions
        rope = np.asarray(inputs.rope_positions, dtype=np.int64).reshape(3, -1)
        # (rows of text alone, the three equal: one row of shifted positions, which every
        # path rotates by; only rows of an image need the three)
        positions = on_device(rope[0] if (rope == rope[0]).all() else rope, torch.int64,
                              device)
    return input_ids, positions, meta


def pending_fill(scheduled: list, previous: tuple[torch.Tensor, dict[str, int]] | None,
                 device: torch.device):
    """Asynchronous scheduling: the step's rows at a position whose token the previous
    step sampled and the host has not seen (StepInputs holds 0 there), as a function
    that copies those tokens (`previous`: on the device, and each request's row there) into
    the step's input ids on the device; None if none."""
    rows, sources = [], []
    index = previous[1] if previous else None
    for i, s in enumerate(scheduled):
        if s.output_pending:  # (a one-token decode: decodes come first, so sequence i is row i)
            rows.append(i)
            sources.append(index[s.request.request_id])
    if not rows:
        return None
    tokens = previous[0]
    if rows == sources == list(range(len(tokens))):  # (steady decoding: one copy)
        return lambda input_ids: input_ids[:len(rows)].copy_(tokens)
    rows_t, sources_t = (on_device(x, torch.int64, device) for x in (rows, sources))

    def fill(input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, rows_t, tokens.index_select(0, sources_t).to(input_ids.dtype))
    return fill


@dataclass
class StepTensors:
    """A step's inputs on the device, as every path takes them."""

    input_ids: torch.Tensor
    # [rows]; M-RoPE: each row's rotary position ([3, rows]: (temporal, height, width),
    # where a row of an image is in the step)
    positions: torch.Tensor
    meta: AttentionMetadata
    inputs: StepInputs
    # a pipeline stage after the first: the previous stage's (hidden, residual)
    intermediate: tuple[torch.Tensor, torch.Tensor] | None
    drafted: bool  # rows of draft tokens are scored (speculative decoding)
    # an image-text model's step reaching images: the first layer's input, image rows in
    # place (vLLM's inputs_embeds); only the eager path takes such a step
    inputs_embeds: torch.Tensor | None = None


class StepPath(ABC):
    @abstractmethod
    def forward(self, step: StepTensors) -> tuple[Any, LogitsRows | None] | None:
        """(final hidden states, the rows they are of: None for every row), or None when this
        path does not take the step. A stage before the last gives its (hidden, residual)."""


class PiecewisePath(StepPath):
    def __init__(self, pieces: Any) -> None:
        self.pieces = pieces

    def forward(self, step: StepTensors) -> tuple[Any, None] | None:
        if (step.inputs.lora_ids or step.inputs_embeds is not None or step.positions.dim() > 1
                or not self.pieces.fits(len(step.input_ids))):
            return None  # (the graphs hold the base model's forward: no adapters)
        return self.pieces.run(step.input_ids, step.positions, step.meta), None


class CompiledCpuPath(StepPath):
    def __init__(self, decode_step: Any) -> None:
        self.decode_step = decode_step

    def forward(self, step: StepTensors) -> tuple[Any, None] | None:
        if step.inputs_embeds is not None or step.positions.dim() > 1 or (
                step.drafted and len(step.inputs.rope_positions)):
            return None  # (drafted rows' lengths are read from positions M-RoPE shifts)
        hidden = self.decode_step(step.input_ids, step.positions, step.meta, step.intermediate,
                                  step.drafted and step.inputs.only_decodes)
        return None if hidden is None else (hidden, None)


class EagerPath(StepPath):
    """`logits_rows_only`: False where something reads every row's hidden state (draft heads)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 logits_rows_only: bool) -> None:
        self.model, self.backend, self.logits_rows_only = model, backend, logits_rows_only

    def forward(self, step: StepTensors) -> tuple[Any, LogitsRows | None]:
        inputs, sample_rows = step.inputs, step.inputs.sample_seqs
        logits_rows = None
        # Prompt logprobs, pooling and scored drafts read every row's hidden state.
        if (self.logits_rows_only and len(sample_rows) < len(step.input_ids)
                and not inputs.prompt_seqs and not inputs.pool_seqs and not step.drafted
                and not inputs.lora_ids):
            logits_rows = LogitsRows.last_of(step.meta, sample_rows, self.backend)
        intermediate = (step.intermediate if step.inputs_embeds is None
                        else (step.inputs_embeds, None))
        hidden = self.model(step.input_ids, step.positions, step.meta, logits_rows,
                            intermediate)
        return hidden, logits_rows


def ordered(pieces: Any, decode_step: Any, eager: EagerPath) -> list[StepPath]:
    """The paths a runner has, in the order it tries them."""
    paths: list[StepPath] = []
    if pieces is not None:
        paths.append(PiecewisePath(pieces))
    if decode_step is not None:
        paths.append(CompiledCpuPath(decode_step))
    return paths + [eager]


def run_first(paths: list[StepPath], step: StepTensors) -> tuple[Any, LogitsRows | None]:
    """The first path that takes the step runs it (the eager path, last, takes every one)."""
    for path in paths:
        out = path.forward(step)
        if out is not None:
            return out
    raise AssertionError("the eager path takes every step")
