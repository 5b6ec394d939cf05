"""Qwen3-Next's multi-token-prediction layer (`mtp.*` in its checkpoint), kept for speculative
decoding (method "mtp") as DeepSeek's are (models/deepseek_mtp.py's `MTPLayer`): the next
token's embedding and the main model's last hidden state, each normed (`pre_fc_norm_embedding`,
`pre_fc_norm_hidden`, (1 + w) RMSNorms), joined and projected back (`fc`), one gated-attention
decoder layer with the model's experts (`mtp.layers.0`), a final norm (`mtp.norm`); logits
from the main model's LM head. A draft after the first reads the layer's final hidden state,
as vLLM chains them. The checkpoint's one layer is read; more are not built."""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.models.deepseek_mtp import MTPLayer
from tokenmill.models.gemma import GemmaRMSNorm
from tokenmill.models.moe import qwen_moe_mlp

# checkpoint name (after "mtp.") -> ours (after "mtp.0.")
_NAMES = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.",
          "pre_fc_norm_hidden.": "hnorm.", "norm.": "final_norm.", "layers.0.": "block."}


def build_mtp(config: Any, make_attention) -> nn.ModuleList:
    """The MTP layer, when the config asks for one (`num_nextn_predict_layers`, 1 where the
    config does not say: Qwen3-Next's configs do not; the loader sets 0 when the engine
    does not speculate with it)."""
    if not getattr(config, "num_nextn_predict_layers", 1):
        return nn.ModuleList()
    index = config.num_hidden_layers  # (the layer's index past the decoder's: its MoE)
    return nn.ModuleList([MTPLayer(config, make_attention(config), qwen_moe_mlp(config, index),
                                   GemmaRMSNorm, chain_normed=True)])


def mtp_name(name: str) -> str | None:
    """Checkpoint name `mtp.X` -> ours `mtp.0.Y`; None for one not built (a second layer)."""
    rest = name[len("mtp."):]
    for theirs, ours in _NAMES.items():
        if rest.startswith(theirs):
            return f"mtp.0.{ours}{rest[len(theirs):]}"
    return None
