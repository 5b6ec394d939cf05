"""SigLIP's vision transformer (Gemma 3's tower): patches of the image through a
convolution (with a bias), learned positions and no class token, pre-norm encoder layers as
CLIP's (clip.py), then a final layer norm. Its attention-pooling head is not run (Gemma 3
reads every patch's state)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.models.vision.clip import ACTIVATIONS, VisionLayer


class SiglipVisionTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"SigLIP vision activation {config.hidden_act!r} is not served.")
        hidden = config.hidden_size
        self.image_size, self.patch_size = config.image_size, config.patch_size
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding(self.num_patches, hidden)
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [images, channels, size, size] -> hidden states [images, patches, hidden]."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2) + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor under the tower -> our parameter name; None: the pooling
        head's (not run)."""
        name = name.removeprefix("vision_model.").removeprefix("embeddings.")
        if name.startswith("head."):
            return None
        if name.startswith("encoder.layers."):
            return name.removeprefix("encoder.").replace(".mlp.", ".")
        return name
