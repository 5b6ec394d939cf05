"""IBM Granite (3.x) on the Llama-family model: embeddings times `embedding_multiplier`,
scores scaled by `attention_multiplier`, each block's output times `residual_multiplier`
before it joins the stream, logits divided by `logits_scaling`. Granite-MoE: every layer a
mixture of experts (top-k logits softmaxed = the softmax renormalized over the top k),
its experts stored as one [experts, 2 * intermediate, hidden] `input_linear` (gate | up)
and one `output_linear`; Granite-MoE-Shared adds an ungated-sum shared expert. Granite 4
(`GraniteMoeHybridForCausalLM`): Mamba-2 mixers (layers/mamba2.py) in most layers' place
of attention, attention without rotary unless `position_embedding_type` is rope, experts
optional (a shared MLP alone)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tokenmill.layers.mamba2 import Mamba2Mixer
from tokenmill.layers.moe import SparseMoE
from tokenmill.models.info import layer_window
from tokenmill.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from tokenmill.models.moe import split_stacked_experts, stacked_experts
from tokenmill.models.nope_attention import NoRopeAttention


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__(config, attention, mlp)
        self.multiplier = float(config.residual_multiplier)

    def forward(self, rope, hidden, residual, meta, logits_rows=None):
        hidden, residual = self.attend(rope, hidden, residual, meta, logits_rows)
        if logits_rows is not None and not logits_rows.count:
            return hidden, residual
        hidden, residual = self.post_attention_layernorm(hidden * self.multiplier, residual)
        return self.mlp(hidden) * self.multiplier, residual


def granite_moe_mlp(config: Any, layer: int) -> nn.Module:
    shared_size = getattr(config, "shared_intermediate_size", 0)
    shared = MLP(config, shared_size, reduce=False) if shared_size else None
    return SparseMoE(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                     True, lambda split: MLP(config, config.intermediate_size, reduce=False,
                                             split=split), shared)


# Granite-MoE's checkpoint names -> ours (its experts' stacked tensors: `_STACKED`)
_NAMES = ((".block_sparse_moe.router.layer.", ".mlp.gate."),
          (".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj."),
          (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."))
_STACKED = {".block_sparse_moe.input_linear.weight": ("gate_up_proj.weight", False),
            ".block_sparse_moe.output_linear.weight": ("down_proj.weight", False)}


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, make_mlp=None, make_attention=None,
                 **options) -> None:
        scale = float(config.attention_multiplier)
        super().__init__(
            config, max_positions, make_mlp=make_mlp,
            make_attention=make_attention or (lambda config, layer: Attention(
                config, bool(getattr(config, "attention_bias", False)), False,
                layer_window(config, layer), scale=scale)),
            make_layer=GraniteDecoderLayer, **options)
        self.model.embed_scale = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.logits_scaling


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite-MoE and Granite-MoE-Shared (3.0 / 3.1 MoE, PowerMoE)."""

    def __init__(self, config: Any, max_positions: int, **options) -> None:
        options.setdefault("make_mlp", granite_moe_mlp)
        super().__init__(config, max_positions, **options)

    def holds(self, name: str) -> bool:
        for suffix in _STACKED:
            if name.endswith(suffix):  # (a rank holds all or some of a layer's experts)
                return super().holds(name.replace(".block_sparse_moe.", ".mlp.experts."))
        return super().holds(self._renamed(name))

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        return super().checkpoint_target(self._renamed(name))

    @staticmethod
    def _renamed(name: str) -> str:
        for theirs, ours in _NAMES:
            name = name.replace(theirs, ours)
        return name

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]
                           ) -> Iterator[tuple[str, Any]]:
        """Its stacked experts as one tensor per expert (loading/checkpoint.py)."""
        return split_stacked_experts(weights, self, _STACKED)


def mamba_config(config: Any) -> SimpleNamespace:
    """Granite 4's `mamba_*` settings under the names Mamba-2's mixer reads."""
    return SimpleNamespace(
        hidden_size=config.hidden_size, expand=config.mamba_expand,
        num_heads=config.mamba_n_heads, n_groups=config.mamba_n_groups,
        state_size=config.mamba_d_state, head_dim=config.mamba_d_head,
        conv_kernel=config.mamba_d_conv, use_bias=config.mamba_proj_bias,
        use_conv_bias=config.mamba_conv_bias, layer_norm_epsilon=config.rms_norm_eps,
        chunk_size=config.mamba_chunk_size,
        time_step_limit=config.time_step_limit or (0.0, float("inf")))


class GraniteMoeHybridForCausalLM(GraniteMoeForCausalLM):
    """Granite 4 (-H): each layer a Mamba-2 mixer or attention, then experts beside a
    shared MLP (or the shared MLP alone)."""

    def __init__(self, config: Any, max_positions: int, **options) -> None:
        types = list(config.layer_types)
        self.experts = bool(config.num_local_experts)
        scale, rope = float(config.attention_multiplier), config.position_embedding_type

        def attention(config: Any, layer: int) -> nn.Module:
            if types[layer] in ("mamba", "linear_attention"):
                return Mamba2Mixer(mamba_config(config))
            kind = Attention if rope == "rope" else NoRopeAttention
            return kind(config, bool(config.attention_bias), False, scale=scale)

        mlp = granite_moe_mlp if self.experts else (
            lambda config, layer: MLP(config, config.shared_intermediate_size))
        super().__init__(config, max_positions, make_mlp=mlp, make_attention=attention,
                         **options)

    def _renamed(self, name: str) -> str:
        if ".mamba." in name:
            name = name.replace(".mamba.conv1d.weight", ".self_attn.conv_weight")
            name = name.replace(".mamba.conv1d.bias", ".self_attn.conv_bias")
            return name.replace(".mamba.norm.weight", ".self_attn.norm_weight").replace(
                ".mamba.", ".self_attn.")
        if not self.experts:  # (the shared MLP is the layer's MLP)
            name = name.replace(".shared_mlp.input_linear.", ".mlp.gate_up_proj.")
            return name.replace(".shared_mlp.output_linear.", ".mlp.down_proj.")
        return GraniteMoeForCausalLM._renamed(name)


def granite_moe_checkpoint(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (a GGUF file's, read under the common names) as a Granite-MoE
    checkpoint stores them: each layer's experts stacked, gate | up in one tensor, the
    shared expert's gate | up joined, the router under its own name."""
    others, experts = stacked_experts(weights)
    out = {}
    for name, tensor in others.items():
        if ".mlp.shared_expert.gate_proj." in name:
            up = others[name.replace(".gate_proj.", ".up_proj.")]
            out[name.split(".mlp.")[0] + ".shared_mlp.input_linear.weight"] = torch.cat(
                [tensor, up])
        elif ".mlp.shared_expert.down_proj." in name:
            out[name.split(".mlp.")[0] + ".shared_mlp.output_linear.weight"] = tensor
        elif ".mlp.shared_expert.up_proj." not in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.router.layer.")] = tensor
    for layer, stacks in experts.items():
        out[f"{layer}.block_sparse_moe.input_linear.weight"] = torch.cat(
            [stacks["gate_proj.weight"], stacks["up_proj.weight"]], dim=1)
        out[f"{layer}.block_sparse_moe.output_linear.weight"] = stacks["down_proj.weight"]
    return out
