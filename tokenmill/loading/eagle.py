"""An EAGLE head's checkpoint (models/eagle.py) loaded for its target: checked against the
target's shapes (start-up errors name the problem), float or quantized; safetensors only."""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.config.quantization import QuantConfig
from tokenmill.layers.kernel_choice import choose_linear_kernels
from tokenmill.loading.checkpoint import iter_safetensors, load_hf_config, resolve_model_path
from tokenmill.models.eagle import Eagle3Head, EagleHead, aux_layer_ids
from tokenmill.quantization import model as qmodel


def eagle3_aux_layers(path: str, target: nn.Module) -> tuple[int, ...]:
    """The target layers whose input states the EAGLE-3 head at `path` reads (from its
    config alone: pipeline stages without the head carry them)."""
    path = resolve_model_path(path)
    return aux_layer_ids(load_hf_config(path), target.config.num_hidden_layers,
                         os.path.basename(path.rstrip("/")))


def load_eagle_head(path: str, target: nn.Module, dtype: torch.dtype, device: torch.device,
                    quantization: str | None = None, version: int = 1) -> nn.Module:
    """The EAGLE-1 or EAGLE-3 head at `path` for `target`, checked against it (start-up
    errors name the problem), float in the target's dtype or quantized as asked."""
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
    with torch.device(device):
        if version == 3:
            aux = aux_layer_ids(config, want.num_hidden_layers, name)
            head = Eagle3Head(config, want, aux)
        else:
            fc_bias = any(n.removeprefix("model.") == "fc.bias" for n in tensors)
            head = EagleHead(config, fc_bias)
    head.to(dtype=dtype)
    params, loaded = dict(head.named_parameters()), set()
    for tensor_name, tensor in tensors.items():
        try:
            target_name = head.checkpoint_target(tensor_name)
            if target_name is None:
                continue
            param_name, shard = target_name
            if param_name == "d2t":  # draft id -> target id offsets
                ids = head.draft_to_target + tensor.to(torch.int64).to(device)
                if tensor.shape != head.draft_to_target.shape or not (
                        (ids >= 0) & (ids < head.target_vocab)).all():
                    raise ValueError(f"maps {tuple(tensor.shape)} draft ids outside the "
                                     f"target's {head.target_vocab} tokens")
                head.draft_to_target = ids
                continue
            if param_name not in params:
                raise ValueError(f"matches no parameter of an EAGLE-{version} head")
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
    if version == 3 and head.lm_head.out_features < head.target_vocab and \
            not any(n.endswith("d2t") for n in tensors):
        raise ValueError(f"EAGLE-3 head {name!r} has a {head.lm_head.out_features}-token "
                         "draft vocabulary and no d2t mapping into the target's.")
    if quantization is not None:
        qmodel.quantize_linears(head, QuantConfig(quantization))
    choose_linear_kernels(head)
    return head.eval()
