"""SigLIP's vision transformer (Gemma 3's and LLaVA-OneVision's tower): patches of the image
through a convolution (with a bias), learned positions and no class token, pre-norm encoder
layers as CLIP's (clip.py), then a final layer norm. Its attention-pooling head is not run
(the models read every patch's state); a LLaVA feature layer (`depth`) stops after that
many layers, before the final norm."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.models.vision.clip import ACTIVATIONS, VisionLayer


class SiglipVisionTower(nn.Module):
    """`depth`: the encoder layers run, their output unnormed (None: all, then the norm)."""

    def __init__(self, config: Any, depth: int | None = None) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"SigLIP vision activation {config.hidden_act!r} is not served.")
        hidden = config.hidden_size
        self.image_size, self.patch_size = config.image_size, config.patch_size
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.num_positions = self.num_patches  # (rows out: no class token)
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding(self.num_patches, hidden)
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(
            config.num_hidden_layers if depth is None else depth))
        self.post_layernorm = (nn.LayerNorm(hidden, eps=config.layer_norm_eps)
                               if depth is None else None)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [images, channels, size, size] -> hidden states [images, patches, hidden]."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2) + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return x if self.post_layernorm is None else self.post_layernorm(x)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor under the tower -> our parameter name; None: not one this
        tower runs (the pooling head, a layer past `depth`, the final norm then)."""
        name = name.removeprefix("vision_model.").removeprefix("embeddings.")
        if name.startswith("head.") or (name.startswith("post_layernorm.")
                                        and self.post_layernorm is None):
            return None
        if name.startswith("encoder.layers."):
            if int(name.split(".")[2]) >= len(self.layers):
                return None
            return name.removeprefix("encoder.").replace(".mlp.", ".")
        return name
