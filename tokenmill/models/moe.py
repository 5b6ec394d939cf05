"""Llama-family decoders whose feed-forward blocks are mixtures of experts (layers/moe.py):
Mixtral (every layer; experts `w1`/`w3`/`w2` in its checkpoints), Qwen2-MoE (q|k|v bias, a
gated shared expert, `decoder_sparse_step` and `mlp_only_layers` choosing the sparse layers)
and Qwen3-MoE (q/k norm); checkpoints storing a layer's experts stacked in one tensor read
as one tensor per expert (`split_stacked_experts`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.layers.linear import whole
from tokenmill.layers.moe import SparseMoE
from tokenmill.models.llama import MLP, LlamaForCausalLM

# Mixtral's checkpoint names (`block_sparse_moe`, its experts' w1 / w3 / w2) -> the names
# the other mixtures of experts (and llama.cpp's tensor map) use
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                 (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def mixtral_name(name: str, to_checkpoint: bool = False) -> str:
    """A Mixtral checkpoint name under the common names, or (`to_checkpoint`) back."""
    pairs = [(b, a) for a, b in MIXTRAL_NAMES] if to_checkpoint else MIXTRAL_NAMES
    if pairs[0][0] not in name:
        return name
    for theirs, ours in pairs:
        name = name.replace(theirs, ours)
    return name


def mixtral_mlp(config: Any, layer: int) -> nn.Module:
    return SparseMoE(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                     True, lambda split: MLP(config, config.intermediate_size, reduce=False,
                                                   split=split))


def qwen_moe_mlp(config: Any, layer: int) -> nn.Module:
    sparse = (layer not in (getattr(config, "mlp_only_layers", None) or [])
              and config.num_experts > 0
              and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
    if not sparse:
        return MLP(config)
    shared_size = getattr(config, "shared_expert_intermediate_size", 0)
    shared = MLP(config, shared_size, reduce=False) if shared_size else None
    return SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                     bool(getattr(config, "norm_topk_prob", False)),
                     lambda split: MLP(config, config.moe_intermediate_size, reduce=False,
                                       split=split),
                     shared, gated_shared=shared is not None)


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, **options) -> None:
        super().__init__(config, max_positions, make_mlp=mixtral_mlp, **options)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        """Mixtral's `block_sparse_moe` is our `mlp`; its experts' w1 = gate, w3 = up, w2 =
        down (mixtral_name, which the GGUF converter uses too)."""
        return super().checkpoint_target(mixtral_name(name))


def split_stacked_experts(weights: Iterable[tuple[str, Any]], model: nn.Module,
                          stacked: dict[str, tuple[str, bool]]) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors with each [experts, ...] tensor named by a suffix of `stacked`
    (-> (our expert tensor, e.g. `down_proj.weight`; stored transposed)) as one tensor per
    expert this rank holds, `model.layers.N.mlp.experts.E.down_proj.weight`; the rest as
    they come."""
    for name, tensor in weights:
        suffix = next((s for s in stacked if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        layer = name[: -len(suffix)]
        leaf, transposed = stacked[suffix]
        moe = model.model.layers[int(layer.rsplit(".", 1)[1])].mlp
        full = whole(tensor)
        for e in range(full.shape[0]):
            if moe.holds_expert(e):
                weight = full[e].t().contiguous() if transposed else full[e]
                yield f"{layer}.mlp.experts.{e}.{leaf}", weight


def stacked_experts(weights: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict]]:
    """The reverse of `split_stacked_experts`, for writing a checkpoint that stacks them:
    (the tensors that are no expert's, {layer prefix: {"gate_proj.weight": [expert 0's,
    expert 1's, ..] stacked, ..}})."""
    others: dict[str, Any] = {}
    parts: dict[str, dict[str, dict[int, Any]]] = {}
    for name, tensor in weights.items():
        if ".mlp.experts." not in name:
            others[name] = tensor
            continue
        layer, rest = name.split(".mlp.experts.")
        index, leaf = rest.split(".", 1)
        parts.setdefault(layer, {}).setdefault(leaf, {})[int(index)] = tensor
    return others, {layer: {leaf: torch.stack([by_index[e] for e in range(len(by_index))])
                            for leaf, by_index in leaves.items()}
                    for layer, leaves in parts.items()}
