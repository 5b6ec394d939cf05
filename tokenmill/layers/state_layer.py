"""`StateLayer`: a token mixer that carries a fixed-size state per sequence instead of K/V
rows (Mamba-2's selective state space, Qwen3-Next's gated DeltaNet), and the short causal
convolution both put in front of their recurrence.

Each layer's states live in tensors the model runner binds (worker/state_cache.py), rows of
the slots: `conv_state` [rows, channels, kernel - 1] (the convolution's last inputs) and
`ssm_state` [rows, ...] (the recurrence's state, float32). A step's sequences
name their rows in `AttentionMetadata.state_slots` (and `state_reads`); a sequence with no
context yet starts from zeros (a slot is reused after its last request finished). The
leading one-token sequences (`num_decodes`) advance together one token; a sequence verifying
draft tokens advances a token at a time, the state after each of its rows kept in a row of
its own (a slot has 1 + num_speculative_tokens rows; the next step reads the row after the
last accepted draft: nothing is rolled back); every other sequence runs its chunk from the
state its previous chunk left (chunked prefill equals one pass: tested)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionMetadata, LogitsRows
from tokenmill.distributed.parallel_state import get_tp_group
from tokenmill.host_to_device import on_device
from tokenmill.layers.host_sync import HostSync
from tokenmill.layers.linear import default_weight_loader, whole


def sectioned_loader(sections: list[int], dim: int = 0):
    """A loader keeping this rank's equal share of each of a checkpoint tensor's `sections`
    along `dim` (a convolution's channels: x | B | C, q | k | v; a per-head vector), side
    by side."""
    tp = get_tp_group()

    def load(param: nn.Parameter, loaded: Any) -> None:
        full = whole(loaded)
        if full.dim() == 3:  # (a Conv1d weight [channels, 1, kernel])
            full = full[:, 0]
        parts = [part.chunk(tp.size, dim)[tp.rank] for part in full.split(sections, dim)]
        default_weight_loader(param, torch.cat(parts, dim))
    return load


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal convolution, SiLU after: x [L, C], weight [C, K],
    state [C, K - 1] (the inputs before x; zeros at the start) -> (y [L, C], new state)."""
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + L]
    y = F.conv1d(full[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    return F.silu(y.t()), full[:, full.shape[1] - state.shape[1]:]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences one token each: x [n, C], state [n, C, K - 1] -> (y [n, C], new state)."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [n, C, K]
    y = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias
    return F.silu(y), window[:, :, 1:]


def verified_groups(meta: AttentionMetadata, device: torch.device) -> list:
    """The step's sequences verifying drafts, by draft count: (count, their first rows,
    their indices), on the device; worked out once a step (the first state layer)."""
    if meta.state_groups is None:
        seqs: dict[int, list[int]] = {}
        for s, count in enumerate(meta.state_drafts):
            if count and s >= meta.num_decodes:
                seqs.setdefault(count, []).append(s)
        loc = meta.query_start_loc
        meta.state_groups = [(count, on_device([loc[s] for s in group], torch.int64, device),
                              on_device(group, torch.int64, device))
                             for count, group in seqs.items()]
    return meta.state_groups


class StateLayer(HostSync, nn.Module):
    """A token mixer with per-sequence state (see the module's text). Subclasses say their
    states' shapes, give the recurrence (`step`, `chunk`) and compute `mix` around `scan`;
    the attention-layer call and the state bookkeeping are here. (HostSync: a step's
    sequences are walked on the host, so no CUDA graph.)"""

    stores_values = False  # (no K/V rows: not among the model's attention layers)

    def __init__(self) -> None:
        super().__init__()
        # bound by the model runner (worker/state_cache.py); empty: a throwaway state
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    @abstractmethod
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's (convolution state, recurrent state) shapes on this rank."""

    @abstractmethod
    def mix(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output rows [T, hidden] for the step's rows x [T, hidden]."""

    @abstractmethod
    def step(self, y: torch.Tensor, inputs: list[torch.Tensor], ssm: torch.Tensor):
        """The recurrence one token of n sequences: y [n, channels] (convolved), `inputs`
        its other inputs ([n, ...] each), ssm [n, ...] -> (out [n, ...], new ssm)."""

    @abstractmethod
    def chunk(self, y: torch.Tensor, inputs: list[torch.Tensor], ssm: torch.Tensor):
        """The recurrence over one sequence's L rows: y [L, channels], inputs [L, ...] each,
        ssm without the sequence dimension -> (out [L, ...], final ssm)."""

    def forward(self, rope, x: torch.Tensor, meta: AttentionMetadata,
                logits_rows: LogitsRows | None = None) -> torch.Tensor:
        """As an attention layer is called; every row advances the state, the output is of
        the `logits_rows` only when given."""
        out = self.mix(x, meta)
        return out if logits_rows is None else out[logits_rows.rows]

    def scan(self, meta: AttentionMetadata, conv_in: torch.Tensor,
             inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        """Every sequence's rows through the convolution (its inputs conv_in [T, channels])
        and the recurrence (`inputs`: its other per-row inputs [T, ...]) into out [T, ...],
        the states read and written as the module's text says."""
        n, loc, drafts = meta.num_decodes, meta.query_start_loc, meta.state_drafts
        weight, bias = self.conv_weight, self.conv_bias
        if n:
            conv, ssm = self.read(meta, slice(0, n), conv_in.dtype)
            y, conv = causal_conv_step(conv_in[:n], weight, bias, conv)
            y, ssm = self.step(y, [t[:n] for t in inputs], ssm)
            out[:n] = y.to(out.dtype)
            self.write(meta, slice(0, n), conv, ssm)
        for s in range(n, meta.num_seqs):
            if drafts and drafts[s]:
                continue  # (verified below, by draft count)
            lo, hi = loc[s], loc[s + 1]
            conv, ssm = self.read(meta, slice(s, s + 1), conv_in.dtype)
            y, conv = causal_conv(conv_in[lo:hi], weight, bias, conv[0])
            y, ssm = self.chunk(y, [t[lo:hi] for t in inputs], ssm[0])
            out[lo:hi] = y.to(out.dtype)
            self.write(meta, slice(s, s + 1), conv[None], ssm[None])
        for count, first, chosen in verified_groups(meta, conv_in.device):
            conv, ssm = self.read(meta, chosen, conv_in.dtype)
            for i in range(count + 1):  # (the state after row i: the slot's row i)
                rows = first + i
                y, conv = causal_conv_step(conv_in[rows], weight, bias, conv)
                y, ssm = self.step(y, [t[rows] for t in inputs], ssm)
                out[rows] = y.to(out.dtype)
                self.write(meta, chosen, conv, ssm, offset=i)

    # ---- the step's states ------------------------------------------------------------
    def read(self, meta: AttentionMetadata, seqs: slice | torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (conv, ssm) states of sequences `seqs`, zeros for those without context."""
        if meta.state_slots is None or self.conv_state.numel() == 0:  # (a profiling step)
            conv_shape, ssm_shape = self.state_shapes()
            n = len(range(meta.num_seqs)[seqs]) if isinstance(seqs, slice) else len(seqs)
            device = self.conv_weight.device
            return (torch.zeros(n, *conv_shape, dtype=dtype, device=device),
                    torch.zeros(n, *ssm_shape, dtype=torch.float32, device=device))
        reads = meta.state_slots if meta.state_reads is None else meta.state_reads
        rows = reads[seqs]
        conv, ssm = self.conv_state.index_select(0, rows), self.ssm_state.index_select(0, rows)
        if isinstance(seqs, slice):  # (a verified sequence always has context)
            lens = meta.context_lens[seqs]
            if 0 in lens:  # (a C-level scan: steady decoding has none)
                fresh = [i for i, length in enumerate(lens) if length == 0]
                conv[fresh] = 0
                ssm[fresh] = 0
        return conv.to(dtype), ssm

    def write(self, meta: AttentionMetadata, seqs: slice | torch.Tensor, conv: torch.Tensor,
              ssm: torch.Tensor, offset: int = 0) -> None:
        """The states of sequences `seqs` into their rows (+ `offset`: a verified row's)."""
        if meta.state_slots is None or self.conv_state.numel() == 0:
            return
        rows = meta.state_slots[seqs]
        if offset:
            rows = rows + offset
        self.conv_state.index_copy_(0, rows, conv.to(self.conv_state.dtype))
        self.ssm_state.index_copy_(0, rows, ssm)
