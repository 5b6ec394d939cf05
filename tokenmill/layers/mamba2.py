"""Mamba-2's mixer (the selective state space of "Transformers are SSMs", its SSD form) as a
`StateLayer`: in_proj -> z | x B C | dt; a causal convolution over x B C; the scan; a gated
group RMSNorm; out_proj. Prompt chunks run the chunked scan (`ssd_chunked`), decodes one
step (`ssd_step`); `ssd_reference`, a token at a time, is the definition both are tested
against. Heads and groups split across tensor-parallel ranks (in_proj's sections each
split, out_proj row-parallel)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.distributed.parallel_state import divide, get_tp_group
from tokenmill.layers.linear import MergedLinear, RowParallelLinear
from tokenmill.layers.state_layer import StateLayer, sectioned_loader


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor):
    """One token of n sequences: state [n, H, P, N], x [n, H, P], dt [n, H] (discretized),
    A / D [H], B / C [n, H, N] -> (y [n, H, P], new state)."""
    decay = torch.exp(dt * A)[..., None, None]
    state = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("nhpk,nhk->nhp", state, C) + D[:, None] * x
    return y, state


def ssd_reference(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                  B: torch.Tensor, C: torch.Tensor, D: torch.Tensor):
    """One sequence a token at a time: state [H, P, N], x [L, H, P], dt [L, H], B / C
    [L, H, N] -> (y [L, H, P], final state)."""
    ys = []
    state = state[None]
    for i in range(x.shape[0]):
        y, state = ssd_step(state, x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D)
        ys.append(y)
    return torch.cat(ys), state[0]


def ssd_chunked(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, chunk: int):
    """`ssd_reference` in chunks of `chunk` tokens: within a chunk as masked matrix
    products, between chunks the state carried."""
    length, heads, _ = x.shape
    pad = -length % chunk
    a = dt * A
    xdt = x * dt[..., None]
    if pad:
        a, xdt, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (a, xdt, B, C))
    count = a.shape[0] // chunk
    a, xdt, B, C = (t.reshape(count, chunk, *t.shape[1:]) for t in (a, xdt, B, C))
    cum = a.cumsum(1)  # [c, Q, H]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (cum[:, :, None] - cum[:, None]).masked_fill(~causal[..., None], float("-inf"))
    scores = torch.einsum("cihn,cjhn->cijh", C, B) * decay.exp()
    y = torch.einsum("cijh,cjhp->cihp", scores, xdt)
    # each chunk's contribution to the state at its end, then the states chunk to chunk
    to_end = (cum[:, -1:] - cum).exp()
    added = torch.einsum("cjhn,cjh,cjhp->chpn", B, to_end, xdt)
    chunk_decay = cum[:, -1].exp()[..., None, None]  # [c, H, 1, 1]
    starts = []
    for i in range(count):
        starts.append(state)
        state = state * chunk_decay[i] + added[i]
    y = y + torch.einsum("cihn,chpn->cihp", C, torch.stack(starts)) * cum.exp()[..., None]
    y = y.reshape(-1, heads, x.shape[2])[:length]
    return y + D[:, None] * x, state


class Mamba2Mixer(StateLayer):
    def __init__(self, config: Any) -> None:
        super().__init__()
        tp = get_tp_group()
        hidden = config.hidden_size
        inner = int(config.expand * hidden)
        heads, groups = config.num_heads, config.n_groups
        self.state_size, self.head_dim = config.state_size, config.head_dim
        self.num_heads = divide(heads, tp.size, "Mamba-2 heads")
        self.num_groups = divide(groups, tp.size, "Mamba-2 groups (n_groups)")
        self.inner = inner // tp.size
        group_channels = groups * self.state_size
        self.in_proj = MergedLinear(hidden, [inner, inner, group_channels, group_channels,
                                             heads], bool(config.use_bias))
        sections = [inner, group_channels, group_channels]
        self.conv_dim = self.inner + 2 * self.num_groups * self.state_size
        self.conv_width = config.conv_kernel
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_width),
                                        requires_grad=False)
        self.conv_weight.weight_loader = sectioned_loader(sections)
        self.conv_bias = None
        if config.use_conv_bias:
            self.conv_bias = nn.Parameter(torch.empty(self.conv_dim), requires_grad=False)
            self.conv_bias.weight_loader = sectioned_loader(sections)
        for name in ("dt_bias", "A_log", "D"):
            param = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            param.weight_loader = sectioned_loader([heads])
            setattr(self, name, param)
        self.norm_weight = nn.Parameter(torch.empty(self.inner), requires_grad=False)
        self.norm_weight.weight_loader = sectioned_loader([inner])
        self.eps = config.layer_norm_epsilon
        self.out_proj = RowParallelLinear(inner, hidden, bool(config.use_bias))
        self.chunk_size = config.chunk_size
        self.dt_limit = tuple(config.time_step_limit)

    def state_shapes(self):
        return ((self.conv_dim, self.conv_width - 1),
                (self.num_heads, self.head_dim, self.state_size))

    def mix(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], -1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        out = x.new_empty(x.shape[0], self.num_heads, self.head_dim)
        self.scan(meta, xbc, [dt], out)
        return self.out_proj(self.gated_norm(out.view(x.shape[0], -1), z))

    def step(self, y: torch.Tensor, inputs: list[torch.Tensor], ssm: torch.Tensor):
        return ssd_step(ssm, *self._recurrence(y, inputs))

    def chunk(self, y: torch.Tensor, inputs: list[torch.Tensor], ssm: torch.Tensor):
        return ssd_chunked(ssm, *self._recurrence(y, inputs), self.chunk_size)

    def _recurrence(self, y: torch.Tensor, inputs: list[torch.Tensor]):
        """The scan's inputs but its state: x, dt, A, B, C, D."""
        xs, B, C = self._split(y)
        return xs, inputs[0], -torch.exp(self.A_log.float()), B, C, self.D.float()

    def _split(self, y: torch.Tensor):
        """Convolved rows [T, conv_dim] -> x [T, H, P], B and C [T, H, N] (float32, each
        group's B and C repeated for its heads)."""
        t, groups = y.shape[0], self.num_groups
        xs, B, C = y.float().split([self.inner, groups * self.state_size,
                                    groups * self.state_size], -1)
        per_group = self.num_heads // groups
        B, C = (m.view(t, groups, self.state_size).repeat_interleave(per_group, 1)
                for m in (B, C))
        return xs.view(t, self.num_heads, self.head_dim), B, C

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each group's channels of y * silu(z) (Mamba-2's norm after the
        gate)."""
        dtype = y.dtype
        g = (y.float() * F.silu(z.float())).view(y.shape[0], self.num_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * g.view(y.shape).to(dtype)
