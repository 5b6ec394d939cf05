"""TensorRT-LLM's adapter tensors: `lora_config` [rows, 3] (module id, layer, rank D) and
`lora_weights` [rows, >= D * in + out * D] (each row A [D, in] then B [out, D] flattened, B
already scaled, zeros after), as its Triton backend takes them per request and as
`hf_lora_convert.py` saves them (`model.lora_config.npy`, `model.lora_weights.npy`, each with
a leading batch dimension of 1). `write_folder` keeps a request's pair as such a folder;
`read_folder` turns one into the pairs adapter.py places on the model's layers (the row's
split needs the layer's shape)."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import numpy as np
import torch

CONFIG_FILE = "model.lora_config.npy"
WEIGHTS_FILE = "model.lora_weights.npy"
# TensorRT-LLM's module ids (LoraManager.LORA_MODULE_IDS) -> the Hugging Face module they
# are on (hf_lora_convert.py's mapping for Llama-style models)
MODULES = {0: "self_attn.qkv_proj", 1: "self_attn.q_proj", 2: "self_attn.k_proj",
           3: "self_attn.v_proj", 4: "self_attn.o_proj", 5: "mlp.gate_proj",
           6: "mlp.down_proj", 7: "mlp.up_proj"}
_NAMES = {8: "cross_attn_qkv", 9: "cross_attn_q", 10: "cross_attn_k", 11: "cross_attn_v",
          12: "cross_attn_dense", 13: "moe_h_to_4h", 14: "moe_4h_to_h", 15: "moe_gate",
          16: "moe_router", 17: "mlp_router", 18: "mlp_gate_up"}
# a folder the server wrote from a request's tensors: removed once its adapter is let go
OWNED_MARKER = ".tokenmill-request-tensors"
MAX_ROWS = 65536  # (a row per module per layer: far beyond any model's count)


class TensorsError(ValueError):
    """The tensors cannot be an adapter (the message names which and why, in one line)."""


def checked(weights: Any, config: Any) -> tuple[np.ndarray, np.ndarray]:
    """(weights [rows, L] float, config [rows, 3] int64) from the two tensors as sent (a
    leading batch dimension of 1 dropped), or TensorsError."""
    try:
        config = np.asarray(config)
        weights = np.asarray(weights)
    except (ValueError, TypeError):
        raise TensorsError("lora_weights and lora_config must be rectangular arrays of "
                           "numbers.") from None
    if config.ndim == 3 and config.shape[0] == 1:
        config = config[0]
    if weights.ndim == 3 and weights.shape[0] == 1:
        weights = weights[0]
    if config.ndim != 2 or config.shape[1] != 3 or not np.issubdtype(config.dtype, np.integer):
        raise TensorsError(f"lora_config must be integers of shape [rows, 3] (module id, "
                           f"layer, rank), got {list(config.shape)} of {config.dtype}.")
    if weights.ndim != 2 or not (np.issubdtype(weights.dtype, np.floating)
                                 or np.issubdtype(weights.dtype, np.integer)):
        raise TensorsError(f"lora_weights must be numbers of shape [rows, values], got "
                           f"{list(weights.shape)} of {weights.dtype}.")
    if not 1 <= config.shape[0] <= MAX_ROWS or weights.shape[0] != config.shape[0]:
        raise TensorsError(f"lora_weights has {weights.shape[0]} rows and lora_config "
                           f"{config.shape[0]}: one row per module and layer, 1 to "
                           f"{MAX_ROWS}.")
    if not np.issubdtype(weights.dtype, np.floating):
        weights = weights.astype(np.float32)
    if not np.isfinite(weights).all():
        raise TensorsError("lora_weights holds a value that is not finite.")
    seen = set()
    for module_id, layer, rank in config.tolist():
        if module_id not in MODULES:
            name = _NAMES.get(module_id, "unknown")
            raise TensorsError(f"lora_config: module id {module_id} ({name}) is not supported "
                               f"(ids 0-7: attention and MLP projections).")
        if layer < 0 or rank < 1:
            raise TensorsError(f"lora_config: row ({module_id}, {layer}, {rank}) needs a layer "
                               ">= 0 and a rank >= 1.")
        if (module_id, layer) in seen:
            raise TensorsError(f"lora_config: module id {module_id} of layer {layer} is given "
                               "twice.")
        seen.add((module_id, layer))
    return weights, config.astype(np.int64)


def write_folder(weights: np.ndarray, config: np.ndarray, folder: str) -> None:
    """`checked` tensors saved as TensorRT-LLM's folder (batch dimension of 1 restored)."""
    os.makedirs(folder, exist_ok=True)
    np.save(os.path.join(folder, WEIGHTS_FILE), weights[None])
    np.save(os.path.join(folder, CONFIG_FILE), config[None].astype(np.int32))


def is_folder(folder: str) -> bool:
    """Whether `folder` holds TensorRT-LLM's two files."""
    return os.path.isfile(os.path.join(folder, CONFIG_FILE)) and os.path.isfile(
        os.path.join(folder, WEIGHTS_FILE))


class _Part:
    """One A or B as a tensor with the two methods adapter.py reads a safetensors slice by."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return {torch.float16: "F16", torch.float64: "F64"}.get(self.tensor.dtype, "F32")

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


def read_folder(folder: str, shape_of: Any) -> tuple[dict[str, Any], dict[str, dict]]:
    """(a PEFT-style config, module -> {"A": part, "B": part}) from a TensorRT-LLM folder.
    `shape_of(module)`: the base layer's (out, in) for a module name, () where another
    pipeline stage holds it, None where it is no layer of this model. Each module's alpha
    equals its rank: the scale (in B) stays 1."""
    try:
        weights, config = checked(np.load(os.path.join(folder, WEIGHTS_FILE),
                                          allow_pickle=False),
                                  np.load(os.path.join(folder, CONFIG_FILE), allow_pickle=False))
    except (OSError, ValueError) as exc:
        raise TensorsError(f"{str(exc).splitlines()[0][:200]}") from None
    found: dict[str, dict] = {}
    alphas = {}
    for (module_id, layer, rank), row in zip(config.tolist(), weights):
        module = f"model.layers.{layer}.{MODULES[module_id]}"
        shape = shape_of(module)
        if shape == ():
            continue  # (another pipeline stage's layer)
        if shape is None:
            raise TensorsError(f"lora_config: module id {module_id} of layer {layer} is not a "
                               "layer of this model.")
        out, cols = shape
        need = rank * (cols + out)
        if need > len(row):
            raise TensorsError(f"lora_weights: the row of module id {module_id}, layer "
                               f"{layer} holds {len(row)} values; rank {rank} on a {out} x "
                               f"{cols} layer needs {need}.")
        values = torch.from_numpy(np.ascontiguousarray(row[:need]))
        found[module] = {"A": _Part(values[:rank * cols].reshape(rank, cols)),
                         "B": _Part(values[rank * cols:].reshape(out, rank))}
        alphas[re.escape(module)] = rank
    ranks = list(alphas.values()) or [1]
    return ({"r": max(ranks), "lora_alpha": max(ranks), "rank_pattern": dict(alphas),
             "alpha_pattern": alphas}, found)


def remove_if_owned(folder: str) -> None:
    """Deletes `folder` if the server wrote it from a request's tensors (`OWNED_MARKER`)."""
    if folder and os.path.isfile(os.path.join(folder, OWNED_MARKER)):
        shutil.rmtree(folder, ignore_errors=True)
