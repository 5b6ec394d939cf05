"""Qwen3-Next (`Qwen3NextForCausalLM`): every `full_attention_interval`-th layer gated
attention (q/k norms, 25 % rotary, the output times sigmoid of a gate the q projection
gives beside each query head), the others the gated DeltaNet (layers/gated_delta_net.py, a
state layer); Qwen2-MoE's experts with a gated shared expert; (1 + w) RMSNorms. Its MTP
layer (models/qwen3_next_mtp.py) is built and read when the engine speculates with it."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tokenmill.distributed.parallel_state import get_tp_group
from tokenmill.layers.gated_delta_net import GatedDeltaNet
from tokenmill.layers.linear import MergedLinear
from tokenmill.models.gemma import GemmaRMSNorm
from tokenmill.models.llama import Attention, DecoderLayer, LlamaForCausalLM, holds_expert
from tokenmill.models.moe import qwen_moe_mlp
from tokenmill.models.qwen3_next_mtp import build_mtp, mtp_name

logger = logging.getLogger(__name__)


class GatedAttention(Attention):
    """Attention whose q projection gives [query | gate] per head; out * sigmoid(gate)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, bool(getattr(config, "attention_bias", False)), True,
                         norm=GemmaRMSNorm)
        tp, qkv, width = get_tp_group(), self.qkv_proj, 2 * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [config.num_attention_heads * width, *qkv.full_sizes[1:]],
            qkv.bias is not None,
            shards=[(tp.rank * self.num_heads * width, self.num_heads * width),
                    *qkv.shards[1:]])

    def forward(self, rope, x: torch.Tensor, meta, logits_rows=None) -> torch.Tensor:
        t, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], -1)
        qg = qg.view(t, heads, 2, self.head_dim)
        gate = qg[:, :, 1].reshape(t, self.q_size)
        q = rope(self.in_order(self.q_norm(qg[:, :, 0].contiguous())))
        k = self.in_order(self.k_norm(k.reshape(t, kv_heads, self.head_dim)))
        v = v.reshape(t, kv_heads, self.head_dim)
        k = self.backend.rotate_and_write(rope, k, v, self.k_cache, self.v_cache,
                                          meta.slot_mapping, 0)[1]
        if logits_rows is not None:
            if not logits_rows.count:
                return x.new_empty(0, x.shape[1])
            rows = logits_rows.rows
            q, k, v, gate, meta = q[rows], k[rows], v[rows], gate[rows], logits_rows.meta
            t = logits_rows.count
        out = self.backend.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                  self.window)
        return self.o_proj(out.reshape(t, self.q_size) * torch.sigmoid(gate))


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    interval = getattr(config, "full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(config.num_hidden_layers)]


class Qwen3NextForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, **options) -> None:
        types = _layer_types(config)
        super().__init__(
            config, max_positions, make_mlp=qwen_moe_mlp,
            make_attention=lambda config, i: (GatedAttention(config)
                                              if types[i] == "full_attention"
                                              else GatedDeltaNet(config)),
            make_layer=lambda config, mixer, mlp: DecoderLayer(config, mixer, mlp,
                                                               GemmaRMSNorm),
            make_norm=GemmaRMSNorm, **options)
        self.mtp = (build_mtp(config, GatedAttention) if self.model.is_first_stage
                    else nn.ModuleList())

    def mtp_layers(self) -> list[nn.Module]:
        return list(self.mtp)

    def holds(self, name: str) -> bool:
        if not name.startswith("mtp."):
            return super().holds(name)
        ours = mtp_name(name)
        return ours is not None and bool(len(self.mtp)) and holds_expert(self.mtp[0].block.mlp,
                                                                          ours)

    def unread(self, name: str) -> bool:
        """(and the MTP layer when the engine does not speculate with it)"""
        return (name.startswith("mtp.") and not self.holds(name)) or super().unread(name)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        """`linear_attn` is the layer's mixer (`self_attn`); conv1d its convolution; `mtp.*`
        the MTP layer's (qwen3_next_mtp.py)."""
        if name.startswith("mtp."):
            name = mtp_name(name) or name
        name = name.replace(".linear_attn.conv1d.weight", ".self_attn.conv_weight")
        return super().checkpoint_target(name.replace(".linear_attn.", ".self_attn."))

    def finish_loading(self, loaded: set[str]) -> None:
        if len(self.mtp) and not any(name.startswith("mtp.") for name in loaded):
            logger.info("The checkpoint has no multi-token-prediction layer's tensors "
                        "(mtp.*): none kept.")
            self.mtp = nn.ModuleList()
        super().finish_loading(loaded)
