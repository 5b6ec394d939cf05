"""gpt-oss (OpenAI's open-weight MoE) on the Llama-family model: biased q|k|v and output
projections, attention sinks (a learned logit per head in each softmax's denominator:
attention/window.py), sliding-window layers (128 tokens) alternating with full ones, YaRN,
and a mixture of experts whose router has a bias (softmax over the top-k logits) and whose
experts are biased MLPs with gpt-oss' clamped SwiGLU: gate clamped above at `limit`, up to
[-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).

Experts are stored stacked, gate and up interleaved column by column; `mlp.experts.*` as
float tensors ([experts, in, out]) or, as OpenAI ships them, MXFP4 (`*_blocks`: two 4-bit
E2M1 values a byte, low nibble first, 32 a block; `*_scales`: each block's power of two,
biased by 127; [experts, out, in]): quantization/mxfp4.py reads those into the int8 kernel
exactly (an E2M1 value times two is a whole number from -12 to 12)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.layers.linear import default_weight_loader
from tokenmill.layers.moe import SparseMoE
from tokenmill.models.info import layer_window
from tokenmill.models.llama import MLP, Attention, LlamaForCausalLM
from tokenmill.models.moe import split_stacked_experts, stacked_experts
from tokenmill.quantization.mxfp4 import MXFP4_PARTS, mxfp4_experts
from tokenmill.quantization.schemes import QuantizedShard

# checkpoint name -> (our expert tensor, stored transposed)
STACKED = {".mlp.experts.gate_up_proj": ("gate_up_proj.weight", True),
           ".mlp.experts.gate_up_proj_bias": ("gate_up_proj.bias", False),
           ".mlp.experts.down_proj": ("down_proj.weight", True),
           ".mlp.experts.down_proj_bias": ("down_proj.bias", False)}


class ClampedSwiGLU(nn.Module):
    """(up + 1) * gate * sigmoid(alpha * gate) of a gate | up row, both clamped."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    @property
    def swiglu_clamp(self) -> tuple[float, float]:
        """(alpha, limit): what the fused CPU experts compute (quantization/mxfp4_experts.py)."""
        return self.alpha, self.limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssAttention(Attention):
    def __init__(self, config: Any, layer: int) -> None:
        super().__init__(config, True, False, layer_window(config, layer), o_bias=True)
        first = self.qkv_proj.shards[0][0] // self.head_dim  # (this rank's first head)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.sinks.weight_loader = lambda param, loaded: default_weight_loader(
            param, loaded.narrow(0, first, self.num_heads))


def gpt_oss_mlp(config: Any, layer: int) -> nn.Module:
    act = ClampedSwiGLU(float(getattr(config, "swiglu_alpha", 1.702)),
                        float(config.swiglu_limit))
    return SparseMoE(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                     True, lambda split: MLP(config, config.intermediate_size, reduce=False,
                                             act=act, split=split, bias=True),
                     router_bias=True)


def deinterleaved(name: str, tensor: Any) -> Any:
    """An expert's gate | up rows (or bias, or kernel tensors) with gate's (even) rows
    first, up's after."""
    if ".gate_up_proj." not in name:
        return tensor
    if isinstance(tensor, QuantizedShard):
        return QuantizedShard(tensor.method, {leaf: deinterleaved(name, t)
                                              for leaf, t in tensor.tensors.items()})
    return torch.cat([tensor[0::2], tensor[1::2]])


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_positions: int, **options) -> None:
        super().__init__(config, max_positions, make_mlp=gpt_oss_mlp,
                         make_attention=GptOssAttention, **options)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        return super().checkpoint_target(name.replace(".mlp.router.", ".mlp.gate."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]
                           ) -> Iterator[tuple[str, Any]]:
        """The checkpoint's stacked experts as one tensor per expert (MXFP4 ones as int8
        kernel tensors), gate and up apart: what the loader reads (loading/checkpoint.py)."""
        per_expert = split_stacked_experts(mxfp4_experts(weights, self), self, STACKED)
        for name, tensor in per_expert:
            yield name, deinterleaved(name, tensor)

    def holds(self, name: str) -> bool:
        if name.endswith(MXFP4_PARTS):  # (a layer's stacked experts: the layer's)
            name = name.rsplit("_", 1)[0]
        return super().holds(name)


def gpt_oss_checkpoint(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (a GGUF file's, read under the common names) as a gpt-oss
    checkpoint stores them (float): each layer's experts stacked [experts, in, out], gate
    and up interleaved row by row (then transposed), their biases likewise."""
    out, experts = stacked_experts(weights)
    for layer, stacks in experts.items():
        prefix = f"{layer}.mlp.experts."
        for leaf, suffix in (("weight", ""), ("bias", "_bias")):
            gate, up = stacks[f"gate_proj.{leaf}"], stacks[f"up_proj.{leaf}"]
            gate_up = torch.stack([gate, up], dim=2).flatten(1, 2)  # (gate, up, gate, ..)
            down = stacks[f"down_proj.{leaf}"]
            if leaf == "weight":
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            out[prefix + "gate_up_proj" + suffix] = gate_up.contiguous()
            out[prefix + "down_proj" + suffix] = down.contiguous()
    return out
