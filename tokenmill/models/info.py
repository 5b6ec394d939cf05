"""What the engine needs to know of a model without building it: the context it serves
(`max_model_len`, LongRoPE's original context) and the attention window of its layers."""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.config.engine import EngineConfig

logger = logging.getLogger(__name__)


def layer_window(config: Any, layer: int) -> int | None:
    """The sliding attention window of `layer`, or None (full attention): every layer's
    `sliding_window` (Mistral v0.1, Phi-3), or those `layer_types` marks (Qwen2 with
    `use_sliding_window` past `max_window_layers`)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types and types[layer] != "sliding_attention":
        return None
    return int(window)


def kv_window(config: Any) -> int | None:
    """The window every layer keeps to (the largest, where windows differ), or None when a
    layer attends to the whole sequence: only then can old blocks be given back."""
    windows = [layer_window(config, i) for i in range(config.num_hidden_layers)]
    return None if None in windows else max(windows)


def longrope_context(hf_config) -> int | None:
    """The context LongRoPE's short factors serve (None for other rope types)."""
    from tokenmill.layers.rotary import longrope_length, rope_parameters  # (imports torch)

    return longrope_length(rope_parameters(hf_config))


# the head counts a family's state layers split across tensor-parallel ranks
STATE_LAYER_HEADS = {"mamba2": ("num_heads", "n_groups"),
                     "qwen3_next": ("linear_num_key_heads",),
                     "granitemoehybrid": ("mamba_n_heads", "mamba_n_groups")}


def has_state_layers(hf_config) -> bool:
    """Whether the model's family has state layers (Mamba-2, gated DeltaNet)."""
    return getattr(hf_config, "model_type", None) in STATE_LAYER_HEADS


def _state_heads(hf_config) -> dict[str, int]:
    return {key: getattr(hf_config, key)
            for key in STATE_LAYER_HEADS.get(getattr(hf_config, "model_type", None), ())}


def tensor_parallel_sizes(hf_config) -> list[int]:
    """The tensor-parallel sizes whose ranks can split the model's attention: each takes a
    share of the query heads, and of the key/value heads, or with fewer key/value heads than
    ranks one of them shared by a whole number of ranks (layers/linear.py's `QKVLinear`);
    and a share of each of its state layers' head counts (`STATE_LAYER_HEADS`)."""
    counts = list(_state_heads(hf_config).values())
    heads = getattr(hf_config, "num_attention_heads", None)  # (Mamba-2: none)
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    return [n for n in range(1, max([heads or 1, *counts]) + 1)
            if (heads is None or heads % n == 0 and (kv % n == 0 if n <= kv else n % kv == 0))
            and all(count % n == 0 for count in counts)]


def check_tensor_parallel(config: EngineConfig, hf_config) -> None:
    """Refuse at start-up, before any rank starts, a tensor-parallel size the model's
    attention cannot be split by, naming the sizes that can."""
    sizes = tensor_parallel_sizes(hf_config)
    tp = config.tensor_parallel_size
    if tp not in sizes:
        heads = getattr(hf_config, "num_attention_heads", None) or 1
        kv = getattr(hf_config, "num_key_value_heads", None) or heads
        state = ", ".join(f"{key} {n}" for key, n in _state_heads(hf_config).items())
        raise ValueError(f"tensor parallel size {tp} (--tensor-parallel-size / MP_NUM) must "
                         f"divide the model's attention heads ({heads}; and its {kv} key/value "
                         f"heads, or be a multiple of them{'; state layers: ' if state else ''}"
                         f"{state}): sizes that can: {', '.join(map(str, sizes))}.")


def derive_max_model_len(config: EngineConfig, hf_config) -> int:
    """The longest sequence served: --max-model-len, within what the model's positions allow."""
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    if getattr(hf_config, "model_type", None) == "mamba2":  # (no positions: no limit)
        model_max = max(model_max, config.max_model_len or 0)
    # LongRoPE: transformers rotates with the short factors while a sequence is within the
    # original context and with the long ones past it. One table serves every sequence here:
    # by default the short factors within the original context (transformers' outputs
    # exactly); a max_model_len past it takes the long factors for every position (as vLLM),
    # so prompts within the original context differ slightly from transformers'.
    original = longrope_context(hf_config)
    if original is not None and original < model_max:
        if config.max_model_len is None:
            logger.warning("LongRoPE: max_model_len defaults to the original context (%d "
                           "tokens, the short factors); --max-model-len up to %d serves long "
                           "context with the long factors.", original, model_max)
            return original
        if config.max_model_len > original:
            logger.warning("LongRoPE: max_model_len %d is past the original context (%d): "
                           "the long factors rotate every position, short prompts included.",
                           config.max_model_len, original)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model's "
                         f"max_position_embeddings ({model_max}).")
    return config.max_model_len
