"""llama.cpp's multimodal projector files (`mmproj-*.gguf`, clip.cpp's format) beside a GGUF
language model (`--mmproj`, llama.cpp's flag): the file's metadata as the image side's
`MultiModalConfig` and its image processor, its tensors as the vision encoder's parameters
under the names llama.cpp's converter gives them (gguf's own tensor-name map, read
backwards; the Gemma 3 norm it stores as 1 + w). Gemma 3's projector is served: the one
ggml-org ships beside every Gemma 3 GGUF."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from tokenmill.config.multimodal import MultiModalConfig
from tokenmill.loading.gguf import _field, _float, _reader

SERVED = ("gemma3",)
# a SigLIP layer's tensors (transformers' names under encoder.layers.N)
_LAYER = ("layer_norm1", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
          "self_attn.out_proj", "layer_norm2", "mlp.fc1", "mlp.fc2")
_TOWER = "vision_tower.vision_model."
# Gemma 3's image marks in its vocabulary
_MARKS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def _vision(path: str) -> Any:
    """The mmproj file's reader, checked to be a vision projector of a served type."""
    reader = _reader(path)
    if _field(reader, "general.architecture") != "clip" or not _field(
            reader, "clip.has_vision_encoder", False):
        raise ValueError(f"{path} is not a llama.cpp vision projector (mmproj) file.")
    kind = _field(reader, "clip.projector_type") or _field(reader, "clip.vision.projector_type")
    if kind not in SERVED:
        raise ValueError(f"mmproj projector type {kind!r} is not served ({', '.join(SERVED)} "
                         "is).")
    return reader


def _hparams(reader: Any) -> SimpleNamespace:
    """The tower's shape and the projector's pooling, as transformers' Gemma3Config holds
    them."""
    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"clip.vision.{key}", default)
        if value is None:
            raise ValueError(f"The mmproj file lacks clip.vision.{key}.")
        return value

    side = int(get("image_size")) // int(get("patch_size"))
    per_side = side // int(get("projector.scale_factor", 4))
    vision = SimpleNamespace(
        hidden_size=int(get("embedding_length")), intermediate_size=int(
            get("feed_forward_length")), num_hidden_layers=int(get("block_count")),
        num_attention_heads=int(get("attention.head_count")),
        image_size=int(get("image_size")), patch_size=int(get("patch_size")),
        layer_norm_eps=float(get("attention.layer_norm_epsilon", 1e-6)),
        hidden_act="gelu_pytorch_tanh", num_channels=3)
    return SimpleNamespace(architectures=["Gemma3ForConditionalGeneration"],
                           vision_config=vision, mm_tokens_per_image=per_side ** 2,
                           text_config=SimpleNamespace(hidden_size=int(get("projection_dim"))))


def mmproj_multimodal(mmproj: str | None, model_path: str, limits: dict[str, int],
                      max_model_len: int) -> MultiModalConfig | None:
    """The image side an mmproj file gives the GGUF language model at `model_path` (None
    without one)."""
    if not mmproj:
        return None
    if not model_path.endswith(".gguf"):
        raise ValueError("--mmproj goes with a GGUF language model (a checkpoint folder "
                         "holds its own vision tower).")
    hparams = _hparams(_vision(mmproj))
    text = _reader(model_path)
    if _field(text, "general.architecture") != "gemma3":
        raise ValueError("A Gemma 3 mmproj file goes with a gemma3 GGUF language model.")
    tokens = list(_field(text, "tokenizer.ggml.tokens") or ())
    missing = [m for m in _MARKS if m not in tokens]
    if missing:
        raise ValueError(f"The language model's vocabulary lacks {', '.join(missing)}.")
    boi, eoi, soft = (tokens.index(m) for m in _MARKS)
    vision = hparams.vision_config
    return MultiModalConfig(
        "Gemma3ForConditionalGeneration", soft, hparams.mm_tokens_per_image,
        vision.image_size, limits["image"], patch_size=vision.patch_size,
        max_rows=max_model_len, placeholder_id=boi, start_id=boi, end_id=eoi, wrap="\n\n",
        bidirectional=True, mmproj=mmproj)


def image_processor(mmproj: str) -> Any:
    """transformers' Gemma 3 image processor at the file's size, mean and std."""
    from transformers import Gemma3ImageProcessor

    reader = _vision(mmproj)
    side = int(_field(reader, "clip.vision.image_size"))
    return Gemma3ImageProcessor(size={"height": side, "width": side},
                                image_mean=[float(x) for x in _field(
                                    reader, "clip.vision.image_mean", [0.5] * 3)],
                                image_std=[float(x) for x in _field(
                                    reader, "clip.vision.image_std", [0.5] * 3)])


def _weights(reader: Any, layers: int) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers' name, float32 tensor) of each tensor the encoder runs."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, layers)
    stored = {t.name: t for t in reader.tensors}
    wanted = [(_TOWER + "embeddings.patch_embedding", ("weight", "bias")),
              (_TOWER + "embeddings.position_embedding", ("weight",)),
              (_TOWER + "post_layernorm", ("weight", "bias")),
              ("multi_modal_projector.mm_input_projection", ("weight",)),
              ("multi_modal_projector.mm_soft_emb_norm", ("weight",))]
    wanted += [(f"{_TOWER}encoder.layers.{i}.{part}", ("weight", "bias"))
               for i in range(layers) for part in _LAYER]
    for base, suffixes in wanted:
        for suffix in suffixes:
            key = f"{names.get_name(base)}.{suffix}"
            if key not in stored:
                raise ValueError(f"The mmproj file lacks {key}.")
            value = _float(stored[key])
            if base.endswith("soft_emb_norm"):  # (stored as 1 + w, as Gemma's norms)
                value = value - 1.0
            name = (f"{base}_weight" if base.endswith("mm_input_projection")
                    else f"{base}.{suffix}")
            yield name, value


def load_mmproj_encoder(mmproj: str, dtype: Any, device: Any) -> Any:
    """The vision encoder of an mmproj file, its tensors read (f32, f16 or quantized
    blocks, dequantized)."""
    import torch

    from tokenmill.models.vision.encoder import build_encoder

    reader = _vision(mmproj)
    config = _hparams(reader)
    with torch.device(device):
        encoder = build_encoder(config)
    encoder.load_weights((name, torch.from_numpy(np.ascontiguousarray(value)))
                         for name, value in _weights(reader,
                                                     config.vision_config.num_hidden_layers))
    return encoder.to(dtype).eval()
