"""GPT-style decoders on the Llama-family model: LayerNorms with biases, ungated MLPs
(up, activation, down), biased projections. Phi-2 runs attention and the MLP side by side
on one normed input (partial rotary: layers/rotary.py's head_order); Starcoder2's layers are
Llama's in that order (and its sliding window)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.layers.activation import activation
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenmill.layers.norm import LayerNorm
from tokenmill.models.info import layer_window
from tokenmill.models.llama import Attention, DecoderLayer, LlamaForCausalLM, norm_eps


class UngatedMLP(nn.Module):
    """fc2(act(fc1(x))), the intermediate size split across tensor-parallel ranks (Phi's
    names; Starcoder2's c_fc / c_proj)."""

    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ParallelDecoderLayer(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)) (Phi-2, GPT-J): carried as (hidden, residual) pairs
    like the Llama layers."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = attention, mlp
        self.input_layernorm = LayerNorm(config.hidden_size, norm_eps(config))

    def forward(self, rope, hidden, residual, meta, logits_rows=None):
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn(rope, normed, meta, logits_rows)
        if logits_rows is not None:
            residual, normed = residual[logits_rows.rows], normed[logits_rows.rows]
            if not logits_rows.count:
                return attended, residual
        return attended + self.mlp(normed), residual


# Phi-2's and Starcoder2's checkpoint names -> ours
_NAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.c_fc.", ".mlp.fc1."),
          (".mlp.c_proj.", ".mlp.fc2."), ("model.final_layernorm.", "model.norm."),
          (".self_attn.q_layernorm.", ".self_attn.q_norm."),
          (".self_attn.k_layernorm.", ".self_attn.k_norm."))


class _GptNames(LlamaForCausalLM):
    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        for theirs, ours in _NAMES:
            name = name.replace(theirs, ours)
        return super().checkpoint_target(name)


class PhiForCausalLM(_GptNames):
    """Phi-2 (and Phi-1.5): its LM head has a bias; `qk_layernorm` LayerNorms q and k per
    head."""

    head_bias = True

    def __init__(self, config: Any, max_positions: int, **options) -> None:
        qk_norm = bool(getattr(config, "qk_layernorm", False))
        super().__init__(
            config, max_positions,
            make_attention=lambda config, layer: Attention(
                config, True, qk_norm, layer_window(config, layer), norm=LayerNorm,
                o_bias=True),
            make_mlp=lambda config, layer: UngatedMLP(config, True),
            make_layer=ParallelDecoderLayer, make_norm=LayerNorm, **options)


class Starcoder2ForCausalLM(_GptNames):
    def __init__(self, config: Any, max_positions: int, **options) -> None:
        bias = bool(getattr(config, "use_bias", True))
        super().__init__(
            config, max_positions,
            make_attention=lambda config, layer: Attention(
                config, bias, False, layer_window(config, layer), o_bias=bias),
            make_mlp=lambda config, layer: UngatedMLP(config, bias),
            make_layer=lambda config, attention, mlp: DecoderLayer(config, attention, mlp,
                                                                   LayerNorm),
            make_norm=LayerNorm, **options)
