"""EAGLE-1 draft heads (method "eagle"): one Llama decoder layer that reads, at position i,
`fc([embedding of token i + 1, the target's final hidden state at i])` and whose output
(residual added, no norm) goes through the target's LM head; run by heads.py like an MTP
layer. The checkpoint layout is EAGLE's (as vLLM reads it): `fc.weight` [H, 2H] (and
`fc.bias`), `layers.0.*` (no `input_layernorm`: EAGLE-1's layer has none), optionally a
`model.` prefix; an `embed_tokens` / `lm_head` copy in it is the target's and not read.
Safetensors only (a pickle can run code when loaded)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tokenmill.layers.linear import Linear, choose_linear_kernels
from tokenmill.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM

SKIPPED = ("embed_tokens.", "lm_head.", "rotary_emb.")


class _NoNorm(nn.Module):
    """EAGLE-1's first layer has no input norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleHead(nn.Module):
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
        if not name.startswith("layers.0."):
            raise ValueError(f"unexpected tensor {name!r} (an EAGLE-1 head holds fc and "
                             "layers.0)")
        name = "block." + name[len("layers.0."):]
        for merged, original, shard in LlamaForCausalLM.stacked_params:
            if f".{original}." in name:
                return name.replace(original, merged), shard
        return name, None


def load_eagle_head(path: str, target: nn.Module, dtype: torch.dtype,
                    device: torch.device, quantization: str | None = None) -> EagleHead:
    """The EAGLE head at `path` for `target`, checked against it (start-up errors name the
    problem), float in the target's dtype or quantized as asked."""
    from tokenmill.loader import iter_safetensors, load_hf_config, resolve_model_path
    from tokenmill.quantization import QuantConfig
    from tokenmill.quantization import model as qmodel

    path = resolve_model_path(path)
    name = os.path.basename(path.rstrip("/"))
    config, want = load_hf_config(path), target.config
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        ours, theirs = getattr(config, field, None), getattr(want, field, None)
        if field == "head_dim":
            ours = ours or config.hidden_size // config.num_attention_heads
            theirs = theirs or want.hidden_size // want.num_attention_heads
        if ours != theirs:
            raise ValueError(f"EAGLE head {name!r} has {field} {ours}, the target {theirs}: "
                             "it was trained for another model.")
    try:
        tensors = dict(iter_safetensors(path))
    except FileNotFoundError:
        raise ValueError(f"EAGLE head {name!r} has no *.safetensors weights (a "
                         "pytorch_model.bin is not read: loading a pickle can run code); "
                         "convert it to safetensors.") from None
    fc_bias = any(n.removeprefix("model.") == "fc.bias" for n in tensors)
    with torch.device(device):
        head = EagleHead(config, fc_bias)
    head.to(dtype=dtype)
    params, loaded = dict(head.named_parameters()), set()
    for tensor_name, tensor in tensors.items():
        try:
            target_name = head.checkpoint_target(tensor_name)
            if target_name is None:
                continue
            param_name, shard = target_name
            if param_name not in params:
                raise ValueError("matches no parameter of an EAGLE-1 head")
            param = params[param_name]
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
        except ValueError as exc:
            raise ValueError(f"EAGLE head {name!r}: tensor {tensor_name!r}: {exc}") from None
        loaded.add(param_name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"EAGLE head {name!r} lacks weights for: {', '.join(missing)}.")
    if quantization is not None:
        qmodel.quantize_linears(head, QuantConfig(quantization))
    choose_linear_kernels(head)
    return head.eval()
