"""`VisionEncoder`: an image-text checkpoint's image side — its tower, the features it
selects, its projector — built from the checkpoint's config, loaded from its tensors.
LLaVA-1.5 (`LlavaForConditionalGeneration`: CLIP tower, MLP projector)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.models.vision.clip import CLIPVisionTower
from tokenmill.models.vision.projector import LlavaProjector

# an image-text checkpoint's image side (old and new transformers layouts)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def text_name(name: str) -> str:
    """An image-text checkpoint's language-model tensor under the text model's name."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name.removeprefix("language_model.")


class VisionEncoder(nn.Module):
    """pixels [images, 3, size, size] -> rows [images, tokens_per_image, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError("Several vision feature layers are not served.")
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"Vision feature strategy {strategy!r} is not served.")
        vision = config.vision_config
        if getattr(vision, "model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"LLaVA with a {vision.model_type} tower is not served (CLIP is).")
        layers = vision.num_hidden_layers
        self.tower = CLIPVisionTower(vision, layers + 1 + layer if layer < 0 else layer)
        self.projector = LlavaProjector.of(config)
        self.drop_cls = strategy == "default"
        self.image_size = vision.image_size
        self.tokens_per_image = self.tower.num_patches + (0 if self.drop_cls else 1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = self.tower(pixels)
        if self.drop_cls:
            features = features[:, 1:]
        return self.projector(features)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's image-side tensors (others skipped); every parameter must come."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            ours = None
            for prefix in VISION_PREFIXES:
                if name.startswith(prefix):
                    rest = name[len(prefix):]
                    ours = (("tower." + t) if (t := self.tower.checkpoint_name(rest)) else None
                            ) if "vision_tower" in prefix else "projector." + rest
                    break
            if ours is None:
                continue
            if ours not in params or params[ours].shape != tensor.shape:
                raise ValueError(f"Checkpoint tensor {name!r} matches no vision parameter.")
            with torch.no_grad():
                params[ours].copy_(tensor)
            loaded.add(ours)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"The checkpoint lacks vision weights: {', '.join(sorted(missing))}.")
