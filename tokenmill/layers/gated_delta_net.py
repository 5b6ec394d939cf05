"""Qwen3-Next's gated DeltaNet (linear attention with a delta-rule state, "Gated Delta
Networks") as a `StateLayer`: in_proj_qkvz and in_proj_ba (grouped by key head), a causal
convolution over q | k | v, the gated delta rule over a [key dim x value dim] state per value
head, a per-head RMSNorm gated by z, out_proj. Prompt chunks run the chunked form
(`gated_delta_chunked`, the WY form FLA uses), decodes one step (`gated_delta_step`);
`gated_delta_reference`, a token at a time, is the definition both are tested against. Key
heads (and their value heads) split across tensor-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.distributed.parallel_state import divide, get_tp_group
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.state_layer import StateLayer, sectioned_loader


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor):
    """One token of n sequences: state [n, H, K, V], q / k [n, H, K] (normed, q scaled),
    v [n, H, V], g (log decay) / beta [n, H] -> (out [n, H, V], new state)."""
    state = state * g.exp()[..., None, None]
    remembered = torch.einsum("nhkv,nhk->nhv", state, k)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", state, q), state


def gated_delta_reference(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """One sequence a token at a time: state [H, K, V], q / k [L, H, K], v [L, H, V],
    g / beta [L, H] -> (out [L, H, V], final state)."""
    outs, state = [], state[None]
    for i in range(q.shape[0]):
        out, state = gated_delta_step(state, q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                      g[i:i + 1], beta[i:i + 1])
        outs.append(out)
    return torch.cat(outs), state[0]


def gated_delta_chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        chunk: int = 64):
    """`gated_delta_reference` in chunks: within a chunk the delta rule's updates folded by
    one triangular solve, between chunks the state carried."""
    length = q.shape[0]
    pad = -length % chunk
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))  # [H, L, d]
    g, beta = (F.pad(t, (0, 0, 0, pad)).t() for t in (g, beta))  # [H, L]
    heads = q.shape[0]
    q, k, v = (t.reshape(heads, -1, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(heads, -1, chunk) for t in (g, beta))
    cum = g.cumsum(-1)  # [H, n, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # (its diagonal: taken as ones)
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                           unitriangular=True)
    keys = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                         unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_in = q * cum.exp()[..., None]
    k_out = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty_like(values)
    for i in range(q.shape[1]):
        fresh = values[:, i] - keys[:, i] @ state
        out[:, i] = q_in[:, i] @ state + scores[:, i] @ fresh
        state = state * chunk_decay[:, i] + k_out[:, i].transpose(-1, -2) @ fresh
    return out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1), state


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(StateLayer):
    def __init__(self, config: Any) -> None:
        super().__init__()
        tp = get_tp_group()
        hidden = config.hidden_size
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.k_heads = divide(k_heads, tp.size, "linear-attention key heads")
        self.ratio = divide(v_heads, k_heads, "linear-attention value heads per key head")
        self.v_heads = self.k_heads * self.ratio
        key_dim, value_dim = k_heads * self.k_dim, v_heads * self.v_dim
        self.in_proj_qkvz = ColumnParallelLinear(hidden, 2 * key_dim + 2 * value_dim)
        self.in_proj_ba = ColumnParallelLinear(hidden, 2 * v_heads)
        self.conv_width = config.linear_conv_kernel_dim
        self.conv_dim = (2 * key_dim + value_dim) // tp.size
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_width),
                                        requires_grad=False)
        self.conv_weight.weight_loader = sectioned_loader([key_dim, key_dim, value_dim])
        self.conv_bias = None
        for name in ("dt_bias", "A_log"):
            param = nn.Parameter(torch.empty(self.v_heads), requires_grad=False)
            param.weight_loader = sectioned_loader([v_heads])
            setattr(self, name, param)
        self.norm = RMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, hidden)

    def state_shapes(self):
        return (self.conv_dim, self.conv_width - 1), (self.v_heads, self.k_dim, self.v_dim)

    def mix(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, kd, vd, r = x.shape[0], self.k_dim, self.v_dim, self.ratio
        q, k, v, z = self.in_proj_qkvz(x).view(t, self.k_heads, -1).split(
            [kd, kd, r * vd, r * vd], -1)
        b, a = self.in_proj_ba(x).view(t, self.k_heads, 2 * r).split([r, r], -1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
        beta = b.reshape(t, -1).float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, -1).float()
                                                   + self.dt_bias.float())
        out = x.new_empty(t, self.v_heads, vd)
        self.scan(meta, mixed, [g, beta], out)
        # RMSNorm of each head's output (before the gate), times silu(z)
        gated = self.norm(out) * F.silu(z.reshape(t, self.v_heads, vd).float()).to(x.dtype)
        return self.out_proj(gated.reshape(t, -1))

    def step(self, y: torch.Tensor, inputs: list[torch.Tensor], ssm: torch.Tensor):
        return gated_delta_step(ssm, *self._heads(y), *inputs)

    def chunk(self, y: torch.Tensor, inputs: list[torch.Tensor], ssm: torch.Tensor):
        return gated_delta_chunked(ssm, *self._heads(y), *inputs)

    def _heads(self, y: torch.Tensor):
        """Convolved rows [T, conv_dim] -> q, k [T, value heads, K] (L2-normed, each key
        head repeated for its value heads, q scaled) and v [T, value heads, V], float32."""
        t = y.shape[0]
        q, k, v = y.float().split([self.k_heads * self.k_dim] * 2
                                  + [self.v_heads * self.v_dim], -1)
        q, k = (l2_normalized(m.view(t, self.k_heads, self.k_dim)).repeat_interleave(
            self.ratio, 1) for m in (q, k))
        return q * self.k_dim ** -0.5, k, v.view(t, self.v_heads, self.v_dim)
