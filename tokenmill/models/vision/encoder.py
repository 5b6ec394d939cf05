"""`VisionEncoder`: an image-text checkpoint's image side — its tower, the features it
selects, its projector — built from the checkpoint's config, loaded from its tensors.
LLaVA-1.5 (`LlavaForConditionalGeneration`: CLIP tower, MLP projector) and LLaVA-NeXT
(`LlavaNextForConditionalGeneration`, and `LlavaOnevisionForConditionalGeneration` over a
SigLIP tower: the same over an image's tiles, packed as
transformers' `pack_image_features` does: the whole image's tile, then the grid's rows with
the resize's padding cut off, each row closed by the learned newline row).
Gemma 3's (`Gemma3VisionEncoder`: a SigLIP tower, patches pooled and projected); `build_encoder`
picks the family's (Qwen2-VL's: qwen_vit.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config.multimodal import TILED_LLAVA, best_resolution, max_tiles
from tokenmill.models.vision.clip import CLIPVisionTower
from tokenmill.models.vision.projector import Gemma3Projector, LlavaProjector
from tokenmill.models.vision.siglip import SiglipVisionTower
from tokenmill.models.vision.weights import load_named

# an image-text checkpoint's image side (old and new transformers layouts)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.", "image_newline", "model.image_newline",
                   "visual.", "model.visual.")


def text_name(name: str) -> str:
    """An image-text checkpoint's language-model tensor under the text model's name."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name.removeprefix("language_model.")


def build_encoder(config: Any) -> nn.Module:
    """The image side of an image-text checkpoint's config: each has `encode(images)` and
    `load_weights(tensors)`."""
    if config.architectures[0] in ("Qwen2VLForConditionalGeneration",
                                   "Qwen2_5_VLForConditionalGeneration"):
        from tokenmill.models.vision.qwen_vit import QwenVisionEncoder
        return QwenVisionEncoder(config)
    if config.architectures[0] == "Gemma3ForConditionalGeneration":
        return Gemma3VisionEncoder(config)
    return VisionEncoder(config)


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
        kind = getattr(vision, "model_type", "clip_vision_model")
        if kind not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(f"LLaVA with a {kind} tower is not served (CLIP and SigLIP are).")
        depth = vision.num_hidden_layers + 1 + layer if layer < 0 else layer
        self.tower = (CLIPVisionTower(vision, depth) if kind == "clip_vision_model"
                      else SiglipVisionTower(vision, depth))
        self.projector = LlavaProjector.of(config)
        self.drop_cls = strategy == "default"
        self.image_size = vision.image_size
        self.tokens_per_image = self.tower.num_positions - (1 if self.drop_cls else 0)
        self.pinpoints, self.max_tiles = None, 0
        if config.architectures[0] in TILED_LLAVA:
            self.pinpoints = [list(p) for p in config.image_grid_pinpoints]
            self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))
            self.max_tiles = max_tiles(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [tiles, 3, size, size] -> each tile's rows [tiles, rows, text hidden]."""
        features = self.tower(pixels)
        if self.drop_cls:
            features = features[:, 1:]
        return self.projector(features)

    def encode(self, images: list[tuple[torch.Tensor, list[int]]]) -> list[torch.Tensor]:
        """Images (pixels, their own (height, width)) -> each one's rows [rows, hidden], all
        their tiles through the tower in one pass."""
        if self.pinpoints is None:
            return list(self(torch.stack([pixels for pixels, _ in images])))
        tiles = self(torch.cat([pixels for pixels, _ in images]))
        out, first = [], 0
        for pixels, size in images:
            out.append(self._pack(tiles[first:first + len(pixels)], size))
            first += len(pixels)
        return out

    def _pack(self, tiles: torch.Tensor, size: list[int]) -> torch.Tensor:
        """LLaVA-NeXT: an image's tiles' rows [tiles, side * side, hidden] in its order
        (LLaVA-OneVision: its grid shrunk to `max_tiles` tiles' worth where it holds more
        than 1.1 x that; an image of several in a request is its whole-image tile alone,
        then a newline row)."""
        newline = self.image_newline.to(tiles.dtype)
        if len(tiles) == 1:
            return torch.cat((tiles[0], newline[None]))
        side = self.image_size // self.tower.patch_size
        height, width = size
        grid_h, grid_w = best_resolution(height, width, self.pinpoints)
        tiles_h, tiles_w = grid_h // self.image_size, grid_w // self.image_size
        grid = tiles[1:].view(tiles_h, tiles_w, side, side, -1)
        grid = grid.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # [hidden, rows, cols]
        rows, cols = grid.shape[1:]
        if width / height > cols / rows:  # (the resize padded top and bottom)
            pad = (rows - int(round(height * (cols / width), 7))) // 2
            grid = grid[:, pad:rows - pad, :]
        else:
            pad = (cols - int(round(width * (rows / height), 7))) // 2
            grid = grid[:, :, pad:cols - pad]
        if self.max_tiles:
            rows, cols = grid.shape[1:]
            ratio = math.sqrt(rows * cols / (self.max_tiles * side ** 2))
            if ratio > 1.1:
                grid = F.interpolate(grid[None], [int(rows // ratio), int(cols // ratio)],
                                     mode="bilinear")[0]
        newline = newline[:, None, None].expand(*grid.shape[:-1], 1)
        grid = torch.cat((grid, newline), dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat((tiles[0], grid))

    def _param_name(self, name: str) -> str | None:
        """A checkpoint tensor's parameter here (None: not one this encoder runs)."""
        if name.endswith("image_newline"):
            return "image_newline"
        name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            rest = self.tower.checkpoint_name(name.removeprefix("vision_tower."))
            return None if rest is None else "tower." + rest
        if name.startswith("multi_modal_projector."):
            return "projector." + name.removeprefix("multi_modal_projector.")
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's image-side tensors (others skipped)."""
        load_named(self, weights, self._param_name)


class Gemma3VisionEncoder(nn.Module):
    """Gemma 3's image side: a SigLIP tower, its patches pooled and projected
    (`Gemma3Projector`): pixels [images, 3, size, size] -> rows [images, tokens, hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tower = SiglipVisionTower(config.vision_config)
        self.projector = Gemma3Projector(config)

    def encode(self, images: list[tuple[torch.Tensor, list[int]]]) -> list[torch.Tensor]:
        return list(self.projector(self.tower(torch.stack([pixels for pixels, _ in images]))))

    def _param_name(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            rest = self.tower.checkpoint_name(name.removeprefix("vision_tower."))
            return None if rest is None else "tower." + rest
        if name == "multi_modal_projector.mm_soft_emb_norm.weight":
            return "projector.norm_weight"
        if name.startswith("multi_modal_projector."):
            return "projector." + name.removeprefix("multi_modal_projector.")
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named(self, weights, self._param_name)
