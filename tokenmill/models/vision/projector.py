"""Projectors: a vision tower's features into the language model's hidden size. LLaVA's:
two linears and an activation; Qwen2-VL's patch merger: each merge block's patches normed,
side by side, through two linears and a GELU (one row for the language model from 2 x 2
patches); Gemma 3's: the patches' grid average-pooled to `mm_tokens_per_image` rows, an RMS
norm (by 1 + w) and one matrix."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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


class VisionRMSNorm(nn.Module):
    """x / rms(x) * w in float32, cast back before the weight (Qwen2.5-VL's)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class PatchMerger(nn.Module):
    """Qwen2-VL's (`rms`: Qwen2.5-VL's, its norm an RMS norm): rows [patches, dim] ->
    [patches / merge^2, out]."""

    def __init__(self, dim: int, out: int, merge: int, rms: bool) -> None:
        super().__init__()
        self.ln_q = VisionRMSNorm(dim) if rms else nn.LayerNorm(dim, eps=1e-6)
        wide = dim * merge ** 2
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, out))
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.wide))


class Gemma3Projector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.side = vision.image_size // vision.patch_size  # patches a side
        self.kernel = self.side // int(config.mm_tokens_per_image ** 0.5)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, config.text_config.hidden_size))
        self.norm_weight = nn.Parameter(torch.empty(vision.hidden_size))
        self.eps = vision.layer_norm_eps

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [images, patches, vision hidden] -> [images, rows, text hidden]."""
        images, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(images, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (x * (1.0 + self.norm_weight.float())).to(features.dtype)
        return x @ self.mm_input_projection_weight
