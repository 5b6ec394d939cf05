"""DeepSeek-V3 / R1's multi-token-prediction (MTP) layers, `num_nextn_predict_layers` of them,
stored after the decoder's layers (`model.layers.{num_hidden_layers + i}`): loaded and kept
for speculative decoding, which drafts the token after next with them.

Each layer joins the embedding of the next token with the main model's last hidden state
(both RMS-normed, concatenated, projected back by `eh_proj`), runs one decoder layer (latent
attention and DeepSeek's experts) and a final norm; logits come from the main model's LM head.
The checkpoint's own copies of the embedding and head (`embed_tokens`, `shared_head.head`)
are the main model's (DeepSeek's README_WEIGHTS) and are not loaded twice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import StepRotary
from tokenmill.models.draft_head import DraftHead
from tokenmill.models.llama import DecoderLayer

# checkpoint tensors of an MTP layer that are the main model's own
SHARED = (".embed_tokens.", ".shared_head.head.")


class MTPLayer(DraftHead):
    """One MTP layer (DeepSeek's; Qwen3-Next's, models/qwen3_next_mtp.py, with its own
    `norm` and chaining its final hidden states where DeepSeek's chain them before the
    final norm: `chain_normed`, as vLLM runs each)."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module,
                 norm: type[nn.Module] = RMSNorm, chain_normed: bool = False) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = norm(hidden, eps)  # the next token's embedding
        self.hnorm = norm(hidden, eps)  # the main model's hidden state
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.block = DecoderLayer(config, attention, mlp, norm)
        self.final_norm = norm(hidden, eps)  # the checkpoint's shared_head.norm
        self.chain_normed = chain_normed

    def forward(self, rope: StepRotary, embeds: torch.Tensor, previous: torch.Tensor,
                meta: Any, chained: bool = False):
        """Final hidden states for the token after each of `embeds`' tokens; `previous`:
        the main model's final hidden states at the same rows (or this layer's own for the
        next draft). `chained`: (final, what the next draft reads)."""
        joined = torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1)
        hidden, residual = self.block(rope, self.eh_proj(joined), None, meta)
        hidden, summed = self.final_norm(hidden, residual)
        if not chained:
            return hidden
        return hidden, hidden if self.chain_normed else summed




def build_mtp(config: Any, make_attention: Callable[[Any, int], nn.Module],
              make_mlp: Callable[[Any, int], nn.Module]) -> nn.ModuleList:
    first = config.num_hidden_layers
    return nn.ModuleList(
        MTPLayer(config, make_attention(config, first + i), make_mlp(config, first + i))
        for i in range(getattr(config, "num_nextn_predict_layers", 0) or 0))


def mtp_name(name: str, num_layers: int) -> str | None:
    """Checkpoint name `model.layers.{num_layers + i}.X` -> our `mtp.{i}.X` (None for the
    tensors the main model already holds); other names as they are."""
    if not name.startswith("model.layers."):
        return name
    layer, rest = name[len("model.layers."):].split(".", 1)
    if int(layer) < num_layers:
        return name
    if any(shared in f".{rest}" for shared in SHARED):
        return None
    rest = rest.replace("shared_head.norm.", "final_norm.")
    if not rest.startswith(("enorm.", "hnorm.", "eh_proj.", "final_norm.")):
        rest = "block." + rest  # the decoder layer's own tensors
    return f"mtp.{int(layer) - num_layers}.{rest}"
