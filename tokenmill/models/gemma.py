"""Gemma 1, 2 and 3 (text) on the Llama-family model: RMSNorms scaling by (1 + weight),
embeddings times sqrt(hidden size), GELU MLPs (Gemma 1: the config's `hidden_act`, its
layers otherwise Llama's); Gemma 2 and 3: a norm after attention and one before and after
the MLP, scores scaled by `query_pre_attn_scalar`, sliding-window layers
alternating with global ones (`layer_types`); Gemma 2 soft-caps attention and final logits,
Gemma 3 norms q and k per head and rotates local and global layers with their own rope
settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.layers.activation import GeluTanhAndMul, gated_activation
from tokenmill.layers.linear import default_weight_loader, whole
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.info import layer_window
from tokenmill.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from tokenmill.models.vision.encoder import VISION_PREFIXES, text_name


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): the checkpoint's w is stored here as 1 + w (the same float32
    product transformers takes)."""

    checkpoint_offset = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = lambda param, loaded: default_weight_loader(
            param, whole(loaded).float() + 1.0)


class SandwichDecoderLayer(DecoderLayer):
    """x + post_ff(mlp(pre_ff(x + post_attn(attn(input(x)))))): a norm before and after
    each block (Gemma 2 and 3; GLM-4 with its own names and plain RMSNorms), carried as
    (hidden, residual) pairs like the Llama layers (the sum of the two is the stream)."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module,
                 norm: type[nn.Module] = GemmaRMSNorm) -> None:
        super().__init__(config, attention, mlp, norm)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, meta, logits_rows=None):
        hidden, residual = self.attend(rope, hidden, residual, meta, logits_rows)
        if logits_rows is not None and not logits_rows.count:
            return hidden, residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1 (2B, 7B; CodeGemma)."""

    def __init__(self, config: Any, max_positions: int, **options) -> None:
        super().__init__(
            config, max_positions,
            make_mlp=lambda config, layer: MLP(config, act=gated_activation(config.hidden_act)),
            make_layer=lambda config, attention, mlp: DecoderLayer(config, attention, mlp,
                                                                   GemmaRMSNorm),
            make_norm=GemmaRMSNorm, **options)
        self.model.embed_scale = config.hidden_size ** 0.5


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False  # (Gemma 3: per-head (1 + w) norms of q and k)

    def __init__(self, config: Any, max_positions: int, **options) -> None:
        scale = config.query_pre_attn_scalar ** -0.5
        super().__init__(
            config, max_positions,
            make_mlp=lambda config, layer: MLP(config, act=GeluTanhAndMul()),
            make_attention=lambda config, layer: Attention(
                config, bool(getattr(config, "attention_bias", False)), self.qk_norm,
                layer_window(config, layer), getattr(config, "attn_logit_softcapping", None),
                scale, norm=GemmaRMSNorm),
            make_layer=SandwichDecoderLayer, make_norm=GemmaRMSNorm, **options)
        self.model.embed_scale = config.hidden_size ** 0.5
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model; from a `Gemma3ForConditionalGeneration` checkpoint (Gemma 3
    4B-27B ship only as that) its language model, the vision tower's tensors not read."""

    qk_norm = True

    def holds(self, name: str) -> bool:
        tied_head = self.tie_word_embeddings and name == "language_model.lm_head.weight"
        if name.startswith(VISION_PREFIXES) or tied_head:
            return False
        return super().holds(text_name(name))

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        return super().checkpoint_target(text_name(name))


def text_config(config: Any) -> Any:
    """The text model's config of a Gemma3ForConditionalGeneration checkpoint, served as
    Gemma3ForCausalLM (its token ids from the outer config where the inner lacks them)."""
    text = config.text_config
    text.architectures = ["Gemma3ForCausalLM"]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text
