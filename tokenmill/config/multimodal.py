"""`MultiModalConfig`: what the API side and the engine need to know of an image-text model
(which token marks an image, how many rows an image becomes, its pixel size, how many images
a request may hold: `--limit-mm-per-prompt`), resolved once at start-up from the checkpoint's
config. None for a text-only model.

The kinds of image side: fixed tiles (LLaVA-1.5; LLaVA-NeXT's and LLaVA-OneVision's
any-resolution grid of them; Gemma 3's one tile, its placeholder wrapped in text and its
rows attending both ways) and dynamic resolution (Qwen2-VL, Qwen2.5-VL: an image resized to
a multiple of the patch size keeps its aspect, its patches' grid decides its rows, and the
language model rotates by M-RoPE positions laid out over that grid)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import msgspec

from tokenmill.config.json_flag import json_object

# image-text architectures served with their images (others' text models only)
VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                       "LlavaOnevisionForConditionalGeneration",
                       "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                       "Gemma3ForConditionalGeneration")
DYNAMIC_RESOLUTION = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
DEFAULT_MAX_IMAGES = 8
TILED_LLAVA = ("LlavaNextForConditionalGeneration", "LlavaOnevisionForConditionalGeneration")


class MultiModalConfig(msgspec.Struct, frozen=True):
    architecture: str
    image_token_id: int
    tokens_per_image: int  # rows of one tile (LLaVA-1.5: of an image)
    image_size: int  # pixels a side of a tile, as the processor resizes and crops
    max_images: int  # per request (--limit-mm-per-prompt '{"image": N}')
    # LLaVA-NeXT's any-resolution tiling: the (height, width) grids an image may be cut to,
    # and the tower's patch size; empty: one tile an image
    grid_pinpoints: list[list[int]] = []
    patch_size: int = 0
    # LLaVA-OneVision's "anyres_max_N": an image's grid rows shrunk to N tiles' worth where
    # they hold more than 1.1 x that; an image of several in a request goes as its
    # whole-image tile alone (0: LLaVA-NeXT, every image tiled)
    max_tiles: int = 0
    # dynamic resolution (Qwen2-VL): patches merged into one row a side (0: fixed tiles),
    # and the values of one patch (channels x temporal patch x patch size squared)
    merge_size: int = 0
    patch_dim: int = 0
    max_rows: int = 1 << 62  # an image's rows at most: the context (max_model_len)
    # Gemma 3: the prompt holds `placeholder_id` once an image (-1: the image token itself),
    # which becomes `wrap` text, `start_id`, the rows, `end_id`, `wrap` text again; the rows
    # attend to each other both ways (`bidirectional`)
    placeholder_id: int = -1
    start_id: int = -1
    end_id: int = -1
    wrap: str = ""
    bidirectional: bool = False
    # a GGUF language model's llama.cpp projector file (--mmproj): the image side's tensors,
    # size and normalization come from it (loading/mmproj.py)
    mmproj: str = ""

    @property
    def prompt_token_id(self) -> int:
        """The token a prompt holds once per image."""
        return self.image_token_id if self.placeholder_id < 0 else self.placeholder_id

    @property
    def dynamic(self) -> bool:
        return self.merge_size > 0

    @property
    def tiled(self) -> bool:
        return bool(self.grid_pinpoints)

    def tiles(self, height: int, width: int) -> int:
        """Tiles of an image of that size: its best grid's, plus the whole image's."""
        grid_h, grid_w = best_resolution(height, width, self.grid_pinpoints)
        return (grid_h // self.image_size) * (grid_w // self.image_size) + 1

    def rows(self, height: int, width: int) -> int:
        """An image's rows (LLaVA-NeXT: the whole image's tile, then its grid's rows with
        the padding the resize added cut off, each row closed by a newline row; as
        transformers' LlavaNextProcessor counts them)."""
        if not self.tiled:
            return self.tokens_per_image
        grid_h, grid_w = best_resolution(height, width, self.grid_pinpoints)
        side = self.image_size // self.patch_size
        rows, cols = side * (grid_h // self.image_size), side * (grid_w // self.image_size)
        if width / height > cols / rows:
            new_height = int(round(height * (cols / width), 7))
            rows -= (rows - new_height) // 2 * 2
        else:
            new_width = int(round(width * (rows / height), 7))
            cols -= (cols - new_width) // 2 * 2
        if self.max_tiles:
            ratio = math.sqrt(rows * cols / (self.max_tiles * side ** 2))
            if ratio > 1.1:
                rows, cols = int(rows // ratio), int(cols // ratio)
        return rows * cols + rows + self.tokens_per_image

    @property
    def untiled_rows(self) -> int:
        """LLaVA-OneVision: an image of several in a request (its whole-image tile, then a
        newline row)."""
        return self.tokens_per_image + 1


def best_resolution(height: int, width: int, pinpoints: list[list[int]]) -> tuple[int, int]:
    """transformers' select_best_resolution: the grid keeping most of the image's pixels,
    then wasting fewest."""
    best, most, waste = None, 0, float("inf")
    for grid_h, grid_w in pinpoints:
        scale = min(grid_w / width, grid_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = grid_w * grid_h - effective
        if effective > most or (effective == most and wasted < waste):
            best, most, waste = (grid_h, grid_w), effective, wasted
    return best


def max_tiles(config: Any) -> int:
    """LLaVA-OneVision's `vision_aspect_ratio` "anyres_max_N": N (0: no such bound)."""
    if config.architectures[0] != "LlavaOnevisionForConditionalGeneration":
        return 0
    ratio = getattr(config, "vision_aspect_ratio", None) or ""
    if not ratio.startswith("anyres_max_") or not ratio[11:].isdigit():
        raise ValueError(f"vision_aspect_ratio {ratio!r} is not served (anyres_max_N is).")
    return int(ratio[11:])


def parse_limits(value: dict | str | None) -> dict[str, int]:
    """`--limit-mm-per-prompt`: {"image": N} (a dict or its JSON text)."""
    value = json_object(value, "--limit-mm-per-prompt")
    if value is None:
        return {"image": DEFAULT_MAX_IMAGES}
    if set(value) - {"image"} or not all(
            type(n) is int and n >= 0 for n in value.values()):
        raise ValueError("limit_mm_per_prompt takes {\"image\": N} with N >= 0 (images are "
                         "the one modality served).")
    return {"image": value.get("image", DEFAULT_MAX_IMAGES)}


def is_image_text(path: str) -> bool:
    """Whether the checkpoint at `path` is an image-text model served with its images."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config, encoding="utf-8") as f:
        raw = json.load(f)
    return bool(raw.get("architectures")) and raw["architectures"][0] in VISION_ARCHITECTURES


def resolve_multimodal(path: str, limits: dict[str, int],
                       max_model_len: int = 1 << 62) -> MultiModalConfig | None:
    if not is_image_text(path):
        return None
    from transformers import AutoConfig

    config: Any = AutoConfig.from_pretrained(path, trust_remote_code=False)
    vision = config.vision_config
    if config.architectures[0] == "Gemma3ForConditionalGeneration":
        return MultiModalConfig(
            "Gemma3ForConditionalGeneration", int(config.image_token_index),
            int(config.mm_tokens_per_image), int(vision.image_size), limits["image"], [],
            int(vision.patch_size), max_rows=max_model_len,
            placeholder_id=int(config.boi_token_index), start_id=int(config.boi_token_index),
            end_id=int(config.eoi_token_index), wrap="\n\n", bidirectional=True)
    if config.architectures[0] in DYNAMIC_RESOLUTION:
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        return MultiModalConfig(config.architectures[0], int(config.image_token_id), 0, 0,
                                limits["image"], patch_size=int(vision.patch_size),
                                merge_size=int(vision.spatial_merge_size),
                                patch_dim=int(patch_dim), max_rows=max_model_len)
    # rows of a tile: its patches, CLIP's class token first (the "default" strategy drops
    # the first row)
    rows = ((vision.image_size // vision.patch_size) ** 2
            + (1 if vision.model_type == "clip_vision_model" else 0)
            - (1 if config.vision_feature_select_strategy == "default" else 0))
    pinpoints = [[int(h), int(w)] for h, w in getattr(config, "image_grid_pinpoints", None)
                 or ()] if config.architectures[0] in TILED_LLAVA else []
    return MultiModalConfig(config.architectures[0], int(config.image_token_index), rows,
                            int(vision.image_size), limits["image"], pinpoints,
                            int(vision.patch_size), max_tiles(config), max_rows=max_model_len)
