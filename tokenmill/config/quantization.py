"""Which quantization method a model runs with (`QuantConfig`), the names users give methods,
and the method a tokenmill-quantized checkpoint records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("int8", "int4", "a8w8", "fp8")
# Other names users bring: the seed's weight-only model names, vLLM/TGI spellings.
ALIASES = {"weight_only_int8": "int8", "wint8": "int8", "w8a16": "int8",
           "weight_only_int4": "int4", "wint4": "int4", "w4a16": "int4",
           "w8a8": "a8w8", "smoothquant": "a8w8", "int8_w8a8": "a8w8", "w8a8_fp8": "fp8"}
CHECKPOINT_FORMAT = "tokenmill"  # `quant_method` of the config.json we write
INT4_DEFAULT_GROUP = 32


@dataclass(frozen=True)
class QuantConfig:
    method: str
    # int4: inputs per scale/min (32, 64, 128); int8: None = one scale per output channel.
    group_size: int | None = None
    # a8w8 / fp8 activations: "dynamic" (range of each call) or "static" (calibrated).
    activation: str = "dynamic"
    fp8_per_channel: bool = True
    smoothquant_alpha: float = 0.5
    # The LM head is a large share of a small model's weight bytes: quantized by default.
    lm_head: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"Unknown quantization method {self.method!r}; choose one of "
                             f"{', '.join(METHODS)} (or {', '.join(sorted(ALIASES))}).")
        if self.method == "int4":
            group = self.group_size or INT4_DEFAULT_GROUP
            if group % 32:
                raise ValueError(f"int4 group size must be a multiple of 32, got {group}.")
            object.__setattr__(self, "group_size", group)
        if self.activation not in ("dynamic", "static"):
            raise ValueError(f"activation must be 'dynamic' or 'static', got "
                             f"{self.activation!r}.")

    def layer_method(self, layer_name: str) -> str:
        """int4 keeps the LM head at 8 bits (as llama.cpp keeps its output layer at 6+ bits):
        4-bit logits cost the default model ~5 % perplexity, 8-bit ones ~0.3 %."""
        if layer_name == "lm_head" and self.method == "int4":
            return "int8"
        return self.method

    def to_json(self) -> dict[str, Any]:
        return {"quant_method": CHECKPOINT_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QuantConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def parse_method(name: str | None) -> str | None:
    """A user's method name (ours or an alias, any case) -> ours; None/"none" -> None."""
    if name is None or str(name).lower() in ("", "none"):
        return None
    name = str(name).lower()
    return ALIASES.get(name, name)


def checkpoint_quant_config(hf_config: Any) -> QuantConfig | None:
    """The method a checkpoint written by `tokenmill quantize` was quantized with."""
    data = getattr(hf_config, "quantization_config", None)
    if not data:
        return None
    if isinstance(data, dict) and data.get("quant_method") == CHECKPOINT_FORMAT:
        return QuantConfig.from_json(data)
    if isinstance(data, dict) and data.get("quant_method") == "fp8":
        return None  # block-scaled float8: read as the float weights (fp8_blocks.py)
    if isinstance(data, dict) and data.get("quant_method") == "mxfp4":
        return None  # gpt-oss' MXFP4 experts: read into the int8 kernel (mxfp4.py)
    method = data.get("quant_method") if isinstance(data, dict) else data
    raise ValueError(f"This checkpoint is quantized with {method!r}, which tokenmill does not "
                     "load; quantize the original weights with `tokenmill quantize`.")
