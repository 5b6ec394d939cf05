"""`MultiModalConfig`: what the API side and the engine need to know of an image-text model
(which token marks an image, how many rows an image becomes, its pixel size, how many images
a request may hold: `--limit-mm-per-prompt`), resolved once at start-up from the checkpoint's
config. None for a text-only model."""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

# image-text architectures served with their images (others' text models only)
VISION_ARCHITECTURES = ("LlavaForConditionalGeneration",)
DEFAULT_MAX_IMAGES = 8


class MultiModalConfig(msgspec.Struct, frozen=True):
    architecture: str
    image_token_id: int
    tokens_per_image: int
    image_size: int  # pixels a side, as the processor resizes and crops
    max_images: int  # per request (--limit-mm-per-prompt '{"image": N}')


def parse_limits(value: dict | str | None) -> dict[str, int]:
    """`--limit-mm-per-prompt`: {"image": N} (a dict or its JSON text)."""
    if value is None:
        return {"image": DEFAULT_MAX_IMAGES}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt is not JSON: {exc.msg}.") from None
    if not isinstance(value, dict) or set(value) - {"image"} or not all(
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


def resolve_multimodal(path: str, limits: dict[str, int]) -> MultiModalConfig | None:
    if not is_image_text(path):
        return None
    from transformers import AutoConfig

    config: Any = AutoConfig.from_pretrained(path, trust_remote_code=False)
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    tokens = patches + (0 if config.vision_feature_select_strategy == "default" else 1)
    return MultiModalConfig(config.architectures[0], int(config.image_token_index), tokens,
                            int(vision.image_size), limits["image"])
