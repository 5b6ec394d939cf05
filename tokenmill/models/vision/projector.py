"""LLaVA's projector: the tower's features into the language model's hidden size, through
two linears and an activation."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.models.vision.clip import ACTIVATIONS


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"Projector activation {act!r} is not served.")
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))

    @classmethod
    def of(cls, config: Any) -> LlavaProjector:
        return cls(config.vision_config.hidden_size, config.text_config.hidden_size,
                   getattr(config, "projector_hidden_act", "gelu"),
                   bool(getattr(config, "multimodal_projector_bias", True)))
