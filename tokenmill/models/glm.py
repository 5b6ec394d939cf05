"""GLM-4 (`GlmForCausalLM`, `Glm4ForCausalLM`) and GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`).

GLM-4 is Llama-shaped with q|k|v biases, no output bias, a stored gate|up projection, and
rotary on interleaved pairs of the first half of each head (layers/rotary.py's head_order);
Glm4 (the 0414 releases) adds a norm after attention and after the MLP (Gemma 2's sandwich,
under GLM's names). GLM-4.5 is DeepSeek-V3's mixture of experts (sigmoid routing by groups,
correction biases, shared experts, first layers dense, MTP layers) beside grouped-query
attention with Neox rotary on part of each head and optional q/k norms."""

from __future__ import annotations

from typing import Any

from tokenmill.layers.norm import RMSNorm
from tokenmill.models.deepseek import DeepseekV3ForCausalLM
from tokenmill.models.gemma import SandwichDecoderLayer
from tokenmill.models.info import layer_window
from tokenmill.models.llama import Attention, LlamaForCausalLM

# Glm4's norm names -> the sandwich layer's (its `post_attention_layernorm` is the norm
# before the MLP)
_GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
               "post_attention_layernorm": "pre_feedforward_layernorm",
               "post_mlp_layernorm": "post_feedforward_layernorm"}


def _glm_attention(config: Any, layer: int) -> Attention:
    return Attention(config, bool(getattr(config, "attention_bias", True)), False,
                     layer_window(config, layer), o_bias=False, interleaved=True)


class GlmForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, **options) -> None:
        super().__init__(config, max_positions, make_attention=_glm_attention, **options)


class Glm4ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, **options) -> None:
        super().__init__(
            config, max_positions, make_attention=_glm_attention,
            make_layer=lambda config, attention, mlp: SandwichDecoderLayer(
                config, attention, mlp, RMSNorm), **options)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        parts = name.split(".")
        return super().checkpoint_target(".".join(_GLM4_NORMS.get(p, p) for p in parts))


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    latent = False

    def __init__(self, config: Any, max_positions: int, **options) -> None:
        qk_norm = bool(getattr(config, "use_qk_norm", False))

        def make_attention(config, layer):
            return Attention(config, bool(getattr(config, "attention_bias", False)), qk_norm,
                             o_bias=False)
        super().__init__(config, max_positions, make_attention=make_attention, **options)
