"""EAGLE draft heads as models, run by worker/draft_heads.py like an MTP layer (their KV
caches on the target's block tables), in the checkpoint layouts EAGLE ships (as vLLM reads
them; loading/eagle.py loads them, safetensors only); any `embed_tokens` copy in them is the
target's and not read.

- EAGLE-1 (method "eagle"): one Llama decoder layer that reads, at position i,
  `fc([embedding of token i + 1, the target's final hidden state at i])`, without an input
  norm; its output (residual added, no norm) goes through the target's LM head. Tensors:
  `fc.weight` [H, 2H] (and `fc.bias`), `layers.0.*`, optionally under `model.`.
- EAGLE-3 ("eagle3"): the target's hidden states entering three of its layers
  (`eagle_aux_hidden_state_layer_ids`, default 2, L / 2 and L - 3), joined and projected by
  `fc` [H, 3H]; a layer whose attention reads [norm(embedding), norm(hidden)] (2H wide)
  with the hidden state as residual; a final `norm`; its own `lm_head` over a draft
  vocabulary mapped into the target's by `d2t` (target id = draft id + d2t[draft id]).
  Tensors: `midlayer.*` (or `layers.0.*`), `fc.weight`, `norm.weight`, `lm_head.weight`,
  `d2t` (`t2d` not needed)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.layers.linear import Linear, QKVLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.draft_head import DraftHead
from tokenmill.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM

SKIPPED = ("embed_tokens.", "lm_head.", "rotary_emb.")
SKIPPED_3 = ("embed_tokens.", "rotary_emb.", "t2d")


class _NoNorm(nn.Module):
    """EAGLE-1's first layer has no input norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleHead(DraftHead):
    def __init__(self, config: Any, fc_bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=fc_bias)
        qkv_bias = bool(getattr(config, "attention_bias", False)) or \
            getattr(config, "model_type", "") == "qwen2"  # (Qwen2's q/k/v carry biases)
        self.block = DecoderLayer(config, Attention(config, qkv_bias, False), MLP(config))
        self.block.input_layernorm = _NoNorm()

    def forward(self, rope, embeds: torch.Tensor, previous: torch.Tensor, meta: Any,
                chained: bool = False):
        """Hidden states for the token after each of `embeds`' tokens (the same for the
        logits and the next draft: EAGLE-1 has no final norm)."""
        hidden, residual = self.block(rope, self.fc(torch.cat([embeds, previous], dim=-1)),
                                      None, meta)
        out = hidden + residual
        return (out, out) if chained else out

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """EAGLE checkpoint name -> (our parameter, shard of a merged one); None: not ours."""
        name = name.removeprefix("model.")
        if name.startswith(SKIPPED):
            return None
        if name.startswith("fc."):
            return name, None
        return _layer_target(name, ("layers.0.",), "an EAGLE-1 head holds fc and layers.0")


def _layer_target(name: str, prefixes: tuple[str, ...], holds: str):
    for prefix in prefixes:
        if name.startswith(prefix):
            name = "block." + name[len(prefix):]
            for merged, original, shard in LlamaForCausalLM.stacked_params:
                if f".{original}." in name:
                    return name.replace(original, merged), shard
            return name, None
    raise ValueError(f"unexpected tensor ({holds})")


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [norm(embedding), norm(hidden)], the hidden
    state as the residual."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn, self.mlp = attention, mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, rope, embeds, hidden, meta):
        joined = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        out = self.self_attn(rope, joined, meta)
        out, residual = self.post_attention_layernorm(out, hidden.clone())
        return self.mlp(out), residual


class Eagle3Head(DraftHead):
    def __init__(self, config: Any, target_config: Any, aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.aux_layers = aux_layers
        self.fc = Linear(len(aux_layers) * target_config.hidden_size, hidden)
        attention = Attention(config, False, False)
        attention.qkv_proj = QKVLinear(2 * hidden, attention.head_dim, heads, kv_heads)
        self.block = Eagle3Layer(config, attention, MLP(config))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = Linear(hidden, draft_vocab)
        self.target_vocab = target_config.vocab_size
        # target id of each draft id (d2t's offsets added at load)
        self.register_buffer("draft_to_target", torch.arange(draft_vocab), persistent=False)

    def target_features(self, aux: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states entering its aux layers (by layer), joined and
        projected."""
        return self.fc(torch.cat([aux[i] for i in self.aux_layers], dim=-1))

    def forward(self, rope, embeds: torch.Tensor, previous: torch.Tensor, meta: Any,
                chained: bool = False):
        hidden, residual = self.block(rope, embeds, previous, meta)
        out, summed = self.norm(hidden, residual)
        return (out, summed) if chained else out

    def logits(self, hidden: torch.Tensor, target_lm_head=None) -> torch.Tensor:
        """Scores over the target's vocabulary from its own LM head over its draft
        vocabulary (-inf where no draft token maps)."""
        scores = self.lm_head(hidden)
        full = scores.new_full((scores.shape[0], self.target_vocab), float("-inf"))
        full[:, self.draft_to_target] = scores
        return full

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        name = name.removeprefix("model.")
        if name.startswith(SKIPPED_3):
            return None
        if name.startswith(("fc.", "norm.", "lm_head.")) or name == "d2t":
            return name, None
        return _layer_target(name, ("midlayer.", "layers.0."),
                             "an EAGLE-3 head holds fc, midlayer, norm, lm_head and d2t")


def aux_layer_ids(config: Any, num_layers: int, name: str) -> tuple[int, ...]:
    """The target layers whose input hidden states an EAGLE-3 head reads."""
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or (
        2, num_layers // 2, num_layers - 3)
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"EAGLE-3 head {name!r} reads the target's layers {list(ids)}; the "
                         f"target has {num_layers} (set eagle_aux_hidden_state_layer_ids in "
                         "its config.json).")
    return tuple(ids)
