"""Model names as PaddleNLP's server (the seed) writes them: `ORG/NAME/<precision>` is the
hub model `ORG/NAME` served at that precision (`weight_only_int8` -> int8 weights, `bfloat16` -> the
dtype, ...). A local path is never split."""

from __future__ import annotations

import os

PRECISIONS = {
    "weight_only_int8": {"quantization": "int8"}, "weight_only_int4": {"quantization": "int4"},
    "wint8": {"quantization": "int8"}, "wint4": {"quantization": "int4"},
    "a8w8_fp8": {"quantization": "fp8"}, "a8w8": {"quantization": "a8w8"},
    "bfloat16": {"dtype": "bfloat16"}, "float16": {"dtype": "float16"},
    "float32": {"dtype": "float32"},
}


def split_precision(model: str | None) -> tuple[str | None, dict[str, str]]:
    """(`model` without a precision segment, the engine settings the segment names)."""
    if not model or os.path.exists(model):
        return model, {}
    parts = model.split("/")
    if len(parts) != 3 or not all(parts) or model.startswith((".", "~")):
        return model, {}
    if parts[2] not in PRECISIONS:
        raise ValueError(f"Model {model!r} is not a local path; as a hub name ORG/NAME/"
                         f"<precision> its last part must be one of {', '.join(PRECISIONS)}.")
    return "/".join(parts[:2]), PRECISIONS[parts[2]]
