"""Mamba-2 (`Mamba2ForCausalLM`): an embedding, pre-norm residual blocks of one Mamba-2
mixer each (layers/mamba2.py, a state layer: no KV cache, no positions), a final norm.
Checkpoint names (`backbone.`, `mixer.`, `norm_f`) map onto the Llama layout's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import LogitsRows
from tokenmill.distributed.parallel_state import get_world
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.mamba2 import Mamba2Mixer
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.stage_layers import make_layers
from tokenmill.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel

# checkpoint name pieces -> ours (the mixer sits where a Llama layer's attention does)
_NAMES = (("backbone.embeddings.", "model.embed_tokens."),
          ("backbone.embedding.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
          ("backbone.layers.", "model.layers."), (".mixer.conv1d.weight", ".self_attn.conv_weight"),
          (".mixer.conv1d.bias", ".self_attn.conv_bias"),
          (".mixer.norm.weight", ".self_attn.norm_weight"), (".mixer.", ".self_attn."),
          (".norm.weight", ".input_layernorm.weight"))


def our_name(name: str) -> str:
    for theirs, ours in _NAMES:
        if theirs in name and not (theirs == ".norm.weight" and "model.norm." in name):
            name = name.replace(theirs, ours)
    return name


class MixerLayer(DecoderLayer):
    """x + mixer(norm(x)): a block with no feed-forward part."""

    def __init__(self, config: Any, mixer: nn.Module) -> None:
        nn.Module.__init__(self)
        self.self_attn = mixer
        self.mlp = None
        self.input_layernorm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, rope, hidden, residual, meta, logits_rows: LogitsRows | None = None):
        return self.attend(rope, hidden, residual, meta, logits_rows)


class Mamba2Model(LlamaModel):
    def __init__(self, config: Any, head_here: bool) -> None:
        nn.Module.__init__(self)
        world = get_world()
        self.is_first_stage, self.is_last_stage = world.is_first_stage, world.is_last_stage
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if world.is_first_stage or (tied and head_here) else None)
        self.stage_layers, self.layers = make_layers(
            config.num_hidden_layers, lambda i: MixerLayer(config, Mamba2Mixer(config)))
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.embed_scale = None

    def forward(self, input_ids, positions, meta, logits_rows: LogitsRows | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        hidden, residual = (intermediate if intermediate is not None
                            else (self.embed_input(input_ids), None))
        last = len(self.layers) - 1
        for i in self.stage_layers:
            hidden, residual = self.layers[i](None, hidden, residual, meta,
                                              logits_rows if i == last else None)
        if not self.is_last_stage:
            return hidden, residual
        return self.norm(hidden, residual)[0]


class Mamba2ForCausalLM(LlamaForCausalLM):
    stacked_params: list = []  # (in_proj is one tensor in the checkpoint too)

    def __init__(self, config: Any, max_positions: int, head_on_first_stage: bool = False,
                 **options) -> None:
        nn.Module.__init__(self)
        self.config = config
        world = get_world()
        head_here = world.is_last_stage or (head_on_first_stage and world.is_first_stage)
        self.model = Mamba2Model(config, head_here)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if head_here or (self.tie_word_embeddings and self.model.embed_tokens is not None):
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if self.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def holds(self, name: str) -> bool:
        return super().holds(our_name(name))

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        return our_name(name), None
