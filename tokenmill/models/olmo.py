"""OLMo 2 (and OLMo 3, its sliding-window layers by `layer_types`) on the Llama-family
model: norms after attention and after the MLP instead of before them, and q and k normed
over the whole projection (every head at once; across tensor-parallel ranks an all-reduce
of the squares: layers/norm.py's ShardedRMSNorm)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.distributed.parallel_state import get_tp_group
from tokenmill.layers.norm import RMSNorm, ShardedRMSNorm
from tokenmill.layers.rotary import StepRotary
from tokenmill.models.info import layer_window
from tokenmill.models.llama import Attention, LlamaForCausalLM, norm_eps


class Olmo2Attention(Attention):
    def __init__(self, config: Any, window: int | None) -> None:
        super().__init__(config, bool(getattr(config, "attention_bias", False)), False, window)
        tp, eps = get_tp_group(), norm_eps(config)
        (q_start, q_rows), (k_start, k_rows) = self.qkv_proj.shards[:2]
        self.q_norm = ShardedRMSNorm(q_start, q_rows, eps, tp)
        self.k_norm = ShardedRMSNorm(k_start, k_rows, eps, tp)

    def rotate_and_write(self, rope: StepRotary, qkv: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        q = self.q_norm(qkv[:, : self.q_size]).view(t, self.num_heads, -1)
        k = self.k_norm(qkv[:, self.q_size: self.q_size + self.kv_size])
        k = k.view(t, self.num_kv_heads, -1)
        caches = (self.k_cache, self.v_cache, meta.slot_mapping)
        return rope(q), self.backend.rotate_and_write(rope, k, v, *caches, 0)[1]


class Olmo2DecoderLayer(nn.Module):
    """x + post_attn(attn(x)), then + post_ff(mlp(.)): the stream is (hidden + residual)."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = attention, mlp
        eps = norm_eps(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, rope, hidden, residual, meta, logits_rows=None):
        stream = hidden if residual is None else hidden + residual
        attended = self.self_attn(rope, stream, meta, logits_rows)
        if logits_rows is not None:
            stream = stream[logits_rows.rows]
            if not logits_rows.count:
                return attended, stream
        stream = stream + self.post_attention_layernorm(attended)
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, **options) -> None:
        super().__init__(
            config, max_positions,
            make_attention=lambda config, layer: Olmo2Attention(config,
                                                                layer_window(config, layer)),
            make_layer=Olmo2DecoderLayer, **options)
