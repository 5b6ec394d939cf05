"""Llama 4 (text; Scout and Maverick's language model) on the Llama-family model.

iRoPE: most layers rotate q and k (interleaved pairs, as Meta's complex rotation) and attend
within their `attention_chunk_size`-token chunk only, their q and k L2-normed (weightless;
the norm commutes with the rotation, which keeps each pair's length, so it is taken before);
every `no_rope_layer_interval`-th layer has no rotary, attends to the whole sequence and
scales its queries by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1
(`attn_temperature_tuning`). Feed-forward blocks alternate dense MLPs and mixtures of
experts (`moe_layers`): the top-k experts by logit, each scaling its input by the logit's
sigmoid, beside a shared expert every token runs through. Experts are stored stacked, their
gate | up as [experts, hidden, 2 * intermediate]. From a `Llama4ForConditionalGeneration`
checkpoint the language model is served and the vision side's tensors are not read."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.layers.moe import SparseMoE
from tokenmill.layers.norm import L2Norm
from tokenmill.layers.rotary import StepRotary
from tokenmill.models.llama import MLP, Attention, LlamaForCausalLM
from tokenmill.models.moe import split_stacked_experts, stacked_experts
from tokenmill.models.nope_attention import NoRopeAttention
from tokenmill.models.vision.encoder import text_name

# a Llama4ForConditionalGeneration checkpoint's image side
VISION = ("vision_model.", "multi_modal_projector.", "model.vision_model.",
          "model.multi_modal_projector.")
# checkpoint name -> (our expert weight, stored transposed)
STACKED = {".feed_forward.experts.gate_up_proj": ("gate_up_proj.weight", True),
           ".feed_forward.experts.down_proj": ("down_proj.weight", True)}


class Llama4Attention(NoRopeAttention):
    def __init__(self, config: Any, layer: int) -> None:
        rotates = bool(config.no_rope_layers[layer])
        super().__init__(config, bool(getattr(config, "attention_bias", False)), False,
                         interleaved=True)
        if rotates:
            self.chunk = getattr(config, "attention_chunk_size", None)
            if getattr(config, "use_qk_norm", False):
                self.q_norm = self.k_norm = L2Norm(eps=config.rms_norm_eps)
        self.rotates = rotates
        self.temperature = (None if rotates or not config.attn_temperature_tuning
                            else (float(config.floor_scale), float(config.attn_scale)))

    def rotate_and_write(self, rope: StepRotary, qkv: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotates:
            return Attention.rotate_and_write(self, rope, qkv, v, meta)
        q, k = super().rotate_and_write(rope, qkv, v, meta)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((rope.positions.float() + 1.0) / floor_scale))
            q = (q * (scales * attn_scale + 1.0).view(-1, 1, 1)).to(q.dtype)
        return q, k


def llama4_mlp(config: Any, layer: int) -> nn.Module:
    if layer not in config.moe_layers:
        return MLP(config, config.intermediate_size_mlp)
    return SparseMoE(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                     False, lambda split: MLP(config, config.intermediate_size, reduce=False,
                                              split=split),
                     MLP(config, config.intermediate_size, reduce=False),
                     router="sigmoid_top_k")


def _our_name(name: str) -> str:
    name = text_name(name).replace(".feed_forward.", ".mlp.")
    return name.replace(".mlp.router.", ".mlp.gate.")


class Llama4ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, **options) -> None:
        super().__init__(config, max_positions, make_mlp=llama4_mlp,
                         make_attention=Llama4Attention, **options)

    def holds(self, name: str) -> bool:
        if name.startswith(VISION):
            return False
        if self.tie_word_embeddings and name == "language_model.lm_head.weight":
            return False
        return super().holds(_our_name(name))  # (stacked experts: the layer's)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        return super().checkpoint_target(_our_name(name))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]
                           ) -> Iterator[tuple[str, Any]]:
        """Its stacked experts as one tensor per expert (loading/checkpoint.py)."""
        renamed = ((text_name(name), tensor) for name, tensor in weights)
        return split_stacked_experts(renamed, self, STACKED)


def llama4_checkpoint(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (a GGUF file's) as a Llama 4 checkpoint stores them: each layer's
    experts stacked, gate | up as [experts, hidden, 2 * intermediate], down transposed."""
    out, experts = stacked_experts(weights)
    for layer, stacks in experts.items():
        gate_up = torch.cat([stacks["gate_proj.weight"], stacks["up_proj.weight"]], dim=1)
        out[f"{layer}.feed_forward.experts.gate_up_proj"] = gate_up.transpose(1, 2)
        out[f"{layer}.feed_forward.experts.down_proj"] = stacks["down_proj.weight"].transpose(
            1, 2)
    return {name: tensor.contiguous() for name, tensor in out.items()}
