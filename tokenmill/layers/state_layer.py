"""`StateLayer`: a token mixer that carries a fixed-size state per sequence instead of K/V
rows (Mamba-2's selective state space, Qwen3-Next's gated DeltaNet), and the short causal
convolution both put in front of their recurrence.

Each layer's states live in tensors of `num_slots` rows the model runner binds
(worker/state_cache.py): `conv_state` [slots, channels, kernel - 1] (the convolution's last
inputs) and `ssm_state` [slots, ...] (the recurrence's state, float32). A step's sequences
name their rows in `AttentionMetadata.state_slots`; a sequence with no context yet starts
from zeros (a slot is reused after its last request finished). The leading one-token
sequences (`num_decodes`) advance together one token; every other sequence runs its chunk
from the state its previous chunk left (chunked prefill equals one pass: tested)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionMetadata, LogitsRows
from tokenmill.distributed.parallel_state import get_tp_group
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


class StateLayer(HostSync, nn.Module):
    """A token mixer with per-sequence state (see the module's text). Subclasses say their
    states' shapes and compute `mix`; the attention-layer call and the state bookkeeping are
    here. (HostSync: a step's sequences are walked on the host, so no CUDA graph.)"""

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

    def forward(self, rope, x: torch.Tensor, meta: AttentionMetadata,
                logits_rows: LogitsRows | None = None) -> torch.Tensor:
        """As an attention layer is called; every row advances the state, the output is of
        the `logits_rows` only when given."""
        out = self.mix(x, meta)
        return out if logits_rows is None else out[logits_rows.rows]

    # ---- the step's states ------------------------------------------------------------
    def read(self, meta: AttentionMetadata, first: int, end: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences first..end-1's (conv, ssm) states, zeros for those without context."""
        conv_shape, ssm_shape = self.state_shapes()
        n = end - first
        device = self.conv_weight.device
        if meta.state_slots is None or self.conv_state.numel() == 0:  # (a profiling step)
            return (torch.zeros(n, *conv_shape, dtype=dtype, device=device),
                    torch.zeros(n, *ssm_shape, dtype=torch.float32, device=device))
        slots = meta.state_slots[first:end]
        conv, ssm = self.conv_state.index_select(0, slots), self.ssm_state.index_select(0, slots)
        lens = meta.context_lens[first:end]
        if 0 in lens:  # (a C-level scan: steady decoding has none)
            fresh = [i for i, length in enumerate(lens) if length == 0]
            conv[fresh] = 0
            ssm[fresh] = 0
        return conv.to(dtype), ssm

    def write(self, meta: AttentionMetadata, first: int, end: int, conv: torch.Tensor,
              ssm: torch.Tensor) -> None:
        if meta.state_slots is None or self.conv_state.numel() == 0:
            return
        slots = meta.state_slots[first:end]
        self.conv_state.index_copy_(0, slots, conv.to(self.conv_state.dtype))
        self.ssm_state.index_copy_(0, slots, ssm)
