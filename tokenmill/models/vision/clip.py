"""CLIP's vision transformer (LLaVA's tower): patches of the image through a
convolution, a class token and learned positions, pre-norm encoder layers (bidirectional
attention, quick-GELU MLP). `forward` gives the hidden states after layer `depth` (LLaVA
reads the second-to-last: the layers after it are never run)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
               "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, n, hidden = x.shape
        q, k, v = (proj(x).view(batch, n, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # (every patch sees every patch)
        return self.out_proj(out.transpose(1, 2).reshape(batch, n, hidden))


class VisionLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, hidden)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """`depth`: how many encoder layers run (the feature layer's index, counted from 1)."""

    def __init__(self, config: Any, depth: int) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"CLIP vision activation {config.hidden_act!r} is not served.")
        hidden = config.hidden_size
        self.image_size, self.patch_size = config.image_size, config.patch_size
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.num_positions = self.num_patches + 1  # (rows out: the class token first)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.position_embedding = nn.Embedding(self.num_patches + 1, hidden)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(depth))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [images, channels, size, size] -> hidden states [images, 1 + patches,
        hidden] (the class token first)."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(pixels), 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        return x

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor under the tower (`vision_model.` dropped) -> our parameter
        name; None: not one this tower runs (a later layer, the post-norm)."""
        name = name.removeprefix("vision_model.").removeprefix("embeddings.")
        if name.startswith("encoder.layers."):
            layer = int(name.split(".")[2])
            if layer >= len(self.layers):
                return None
            name = name.removeprefix("encoder.")
            return name.replace(".mlp.", ".")
        if name.startswith("post_layernorm."):
            return None
        return name
