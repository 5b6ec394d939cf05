"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`, as `peft` saves
them) read and checked against the base model it is served with: each low-rank pair placed
on our layer that holds its module (q|k|v and gate|up are merged here), cut to this rank's
part under tensor parallel, its scale folded into B. Every refusal is one line naming the
adapter and, where there is one, the module."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
from tokenmill.loading.file_checks import ModelFileError, check_json_file, check_safetensors
from tokenmill.lora import trtllm_format
from tokenmill.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."

# PEFT features whose weights would change what the model computes beyond A and B: refused by
# name rather than served wrong (config key -> what the error calls it).
_REFUSED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of base layers)",
    "lora_bias": "lora_bias",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layers)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters (LoRA on expert parameters)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}


class LoRAError(ValueError):
    """An adapter refused (its message is one line and names what is wrong)."""


@dataclass
class LoRAWeights:
    """One layer's part of an adapter: per projection of the layer (None: the layer is one
    projection; 0, 1, 2: q, k, v or gate, up of a merged layer), A [r, in] and B [out, r]
    with the scale folded in, both this rank's part."""

    pairs: dict[int | None, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    layers: dict[str, LoRAWeights]  # our layer's module name -> its pairs

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.layers.values()
                   for pair in w.pairs.values() for t in pair)


def adapter_folder(request: LoRARequest) -> str:
    """The adapter's local folder: its path, or a hub name (ORG/NAME) fetched through the
    engine's hub code (the verified cached copy when there is one)."""
    from tokenmill.hub.fetch import HubError, looks_like_repo, resolve

    path = request.lora_path
    if os.path.isdir(path) or not looks_like_repo(path):
        return path
    try:
        return resolve(path)
    except HubError as exc:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {exc}") from None


def _config(request: LoRARequest, folder: str, max_rank: int) -> dict[str, Any]:
    where = f"LoRA adapter {request.lora_name!r}"
    path = os.path.join(folder, CONFIG_FILE)
    if not folder or not os.path.isfile(path):
        raise LoRAError(f"{where}: no {CONFIG_FILE} in its folder {request.lora_path!r}.")
    if not os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
        raise LoRAError(f"{where}: no {WEIGHTS_FILE} in its folder (only safetensors "
                        "adapters are read).")
    try:
        check_json_file(path)
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ModelFileError, ValueError, UnicodeDecodeError) as exc:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not valid: {str(exc).splitlines()[0]}"
                        ) from None
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} is not a JSON object.")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA.")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise LoRAError(f"{where}: {what} is not supported.")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={config['bias']!r} is not supported (only 'none').")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {r!r}.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}.")
    ranks = [r, *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in ranks):
        raise LoRAError(f"{where}: rank_pattern holds a rank that is not a positive integer.")
    if max(ranks) > max_rank:
        raise LoRAError(f"{where}: rank {max(ranks)} is above --max-lora-rank ({max_rank}).")
    for patterns in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(patterns) or {}, dict):
            raise LoRAError(f"{where}: {patterns} is not a JSON object.")
    return config


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's name
    (as a whole or as its dotted tail)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


def load_adapter(request: LoRARequest, model: nn.Module, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> LoRAAdapter:
    """The adapter of `request` for `model` (a PEFT folder, or TensorRT-LLM's tensors saved
    as a folder: lora/trtllm_format.py), or LoRAError."""
    from safetensors import safe_open

    where = f"LoRA adapter {request.lora_name!r}"
    folder = adapter_folder(request)
    modules = dict(model.named_modules())
    if (folder and trtllm_format.is_folder(folder)
            and not os.path.isfile(os.path.join(folder, CONFIG_FILE))):
        try:
            config, found = trtllm_format.read_folder(
                folder, lambda module: _shape_of(model, modules, module))
        except trtllm_format.TensorsError as exc:
            raise LoRAError(f"{where}: {exc}") from None
        return _placed(request, config, found, model, modules, max_rank, dtype, device)
    config = _config(request, folder, max_rank)
    weights_path = os.path.join(folder, WEIGHTS_FILE)
    try:
        check_safetensors(weights_path)
    except ModelFileError as exc:
        raise LoRAError(f"{where}: {exc}") from None
    found: dict[str, dict[str, Any]] = {}  # peft module name -> {"A": slice, "B": slice}
    with safe_open(weights_path, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            module, part = _split_key(key, where)
            found.setdefault(module, {})[part] = f.get_slice(key)
        return _placed(request, config, found, model, modules, max_rank, dtype, device)


def _shape_of(model: nn.Module, modules: dict[str, nn.Module], module: str
              ) -> tuple[int, int] | tuple[()] | None:
    """A checkpoint module's base weight shape (out, in); () where another pipeline stage
    holds it; None where it is no linear layer of this model."""
    if not model.holds(f"{module}.weight"):
        return () if _in_model(modules, module) else None
    target, shard = model.checkpoint_target(f"{module}.weight")
    layer = modules.get(target.removesuffix(".weight"))
    return _full_sizes(layer, shard) if isinstance(layer, Linear) else None


def _in_model(modules: dict[str, nn.Module], module: str) -> bool:
    """Whether a decoder layer `module` is in ("model.layers.N.*": that layer exists, on
    this pipeline stage or another)."""
    parts = module.split(".")
    return len(parts) < 3 or ".".join(parts[:3]) in modules


def _placed(request: LoRARequest, config: dict[str, Any], found: dict[str, dict[str, Any]],
            model: nn.Module, modules: dict[str, nn.Module], max_rank: int,
            dtype: torch.dtype, device: torch.device) -> LoRAAdapter:
    """Each module's pair checked and placed on the layer of ours that holds it."""
    where = f"LoRA adapter {request.lora_name!r}"
    layers: dict[str, LoRAWeights] = {}
    rank = 0
    for module, parts in found.items():
        saved = parts.pop("base", None)  # (PEFT's copy of a targeted embedding / head)
        if saved is not None and not parts:
            raise LoRAError(f"{where}: module {module!r} is a saved copy of a base layer "
                            "(modules_to_save), which is not supported.")
        if set(parts) != {"A", "B"}:
            raise LoRAError(f"{where}: module {module!r} has lora_{next(iter(parts))} "
                            "without its other half.")
        target, shard = model.checkpoint_target(f"{module}.weight")
        if not model.holds(f"{module}.weight"):
            if not _in_model(modules, module):
                raise LoRAError(f"{where}: module {module!r} is not a layer of this model "
                                "(an adapter of another base model?).")
            continue  # (another pipeline stage's layer)
        layer_name = target.removesuffix(".weight")
        layer = modules.get(layer_name)
        if saved is not None:
            _check_saved_copy(saved, layer, module, where, dtype)
        if isinstance(layer, VocabParallelEmbedding):
            a, b = _embedding_pair(parts["A"], parts["B"], layer, module, where)
            rank = max(rank, a.shape[0])
            scale = _scale(config, module, a.shape[0])
            layers[layer_name] = LoRAWeights({None: (
                a.to(device=device, dtype=dtype).contiguous(),
                (b.to(torch.float32) * scale).to(device=device, dtype=dtype))})
            continue
        # (experts, a router, MLA's kv_b_proj whose weight attention reads directly: their
        # products do not go through the layer's forward, so an adapter there is refused)
        if (not isinstance(layer, Linear) or ".experts." in layer_name
                or layer.keep_weight or layer.keep_float):
            raise LoRAError(f"{where}: module {module!r} is not a linear layer of this "
                            "model that takes adapters (experts, routers and latent "
                            "attention's kv_b_proj do not).")
        a, b = _checked_pair(parts["A"], parts["B"], layer, shard, module, where)
        rank = max(rank, a.shape[0])
        scale = _scale(config, module, a.shape[0])
        a = a.to(device=device, dtype=dtype).contiguous()
        b = (b.to(torch.float32) * scale).to(device=device, dtype=dtype)
        pairs = layers.setdefault(layer_name, LoRAWeights({})).pairs
        for index, b_part in _by_projection(layer, shard, b).items():
            pairs[index] = (a, b_part.contiguous())
    if not layers:
        raise LoRAError(f"{where}: its weights hold no LoRA pairs for this model.")
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} is above --max-lora-rank ({max_rank}).")
    return LoRAAdapter(request, rank, layers)


def _scale(config: dict[str, Any], module: str, r: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module,
                           config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _split_key(key: str, where: str) -> tuple[str, str]:
    """'base_model.model.<module>.lora_A.weight' -> (<module>, 'A'); an embedding's
    '.lora_embedding_A' likewise; a targeted embedding's or head's saved base weight
    ('.base_layer.weight', PEFT's save_embedding_layers) -> (<module>, 'base')."""
    suffixes = [(f".lora_{part}{tail}", part) for part in ("A", "B")
                for tail in (".weight", ".default.weight")]
    suffixes += [(f".lora_embedding_{part}{tail}", part) for part in ("A", "B")
                 for tail in ("", ".default")]
    suffixes.append((".base_layer.weight", "base"))
    for suffix, part in suffixes:
        if key.endswith(suffix) and key.startswith(_PREFIX):
            return key[len(_PREFIX):-len(suffix)], part
    raise LoRAError(f"{where}: tensor {key[:120]!r} is not a LoRA A or B weight "
                    "(DoRA magnitudes, biases and saved modules are not supported).")


def _check_saved_copy(saved: Any, layer: nn.Module | None, module: str, where: str,
                      dtype: torch.dtype) -> None:
    """PEFT saves a targeted embedding's or LM head's whole base weight beside its pair (to
    carry a resized or trained vocabulary): served only where it is the base model's own
    (its shape always; its values where the base layer's are float: a quantized base's
    rounded weights cannot equal them)."""
    if isinstance(layer, VocabParallelEmbedding):
        first, local = layer.first, layer.rows
        width = layer.weight.shape[1] if layer.weight is not None else layer.head.in_features
        vocab = layer.vocab_size
    elif isinstance(layer, Linear):
        first = layer.tp.rank * layer.out_features if isinstance(
            layer, ColumnParallelLinear) else 0
        local, width = layer.out_features, layer.in_features
        vocab = getattr(layer, "full_out", layer.out_features)
    else:
        return  # (not a layer adapters are served on: refused below)
    shape = list(saved.get_shape())
    if shape != [vocab, width]:
        raise LoRAError(f"{where}: module {module!r} carries its own base weight {shape}, not "
                        f"this base model's ({vocab} x {width}): a resized vocabulary is not "
                        "supported.")
    rows = max(0, min(local, vocab - first))
    ours, stored = _base_rows(layer, rows, dtype)
    if ours is not None and not torch.equal(
            saved[first:first + rows].to(stored).to(ours.dtype), ours):
        raise LoRAError(f"{where}: module {module!r} carries its own base weight, which is "
                        "not this base model's (a trained vocabulary is not supported).")


def _base_rows(layer: nn.Module, rows: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor | None, torch.dtype]:
    """(the first `rows` rows of a layer's float base weight on the CPU, the dtype it is
    stored in), or None where the layer holds it quantized. A Linear whose kernel repacked
    it: read back through the kernel (the identity's product, exact for float weights)."""
    weight = getattr(layer, "weight", None)
    if weight is not None and not weight.is_meta:
        return weight[:rows].cpu(), weight.dtype
    kind = type(getattr(layer, "kernel", None)).__name__
    if (not isinstance(layer, Linear) or layer.bias is not None
            or kind not in ("CpuPackedKernel", "CpuBf16Kernel")):
        return None, dtype
    eye = torch.eye(layer.in_features, dtype=dtype)
    ours = torch.cat([layer.kernel.apply(layer, eye[i:i + 64])[:, :rows].T
                      for i in range(0, layer.in_features, 64)], dim=1)
    return ours, torch.bfloat16 if kind == "CpuBf16Kernel" else torch.float32


def _embedding_pair(a_slice: Any, b_slice: Any, layer: VocabParallelEmbedding, module: str,
                    where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedding's lora_embedding_A [r, vocab] (this rank's rows of the vocabulary, the
    padding zeros) and lora_embedding_B [hidden, r], after their shapes are checked."""
    a_shape, b_shape = list(a_slice.get_shape()), list(b_slice.get_shape())
    hidden = layer.weight.shape[1] if layer.weight is not None else layer.head.in_features
    if (len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]
            or a_shape[1] != layer.vocab_size or b_shape[0] != hidden):
        raise LoRAError(f"{where}: module {module!r}: lora_embedding_A {a_shape} / "
                        f"lora_embedding_B {b_shape} do not fit the embedding "
                        f"({layer.vocab_size} x {hidden}): an adapter of another base model?")
    kept = max(0, min(layer.rows, layer.vocab_size - layer.first))
    a = torch.zeros(a_shape[0], layer.rows, dtype=_dtype(a_slice))
    a[:, :kept] = a_slice[:, layer.first:layer.first + kept]
    return a, b_slice[:]


def _by_projection(layer: Linear, shard: int | None, b: torch.Tensor
                   ) -> dict[int | None, torch.Tensor]:
    """B of a checkpoint module that is a whole merged layer (Phi-3's fused qkv_proj /
    gate_up_proj) as one B per projection, each cut to this rank's rows: the layer's slots
    hold a pair per projection. Any other module's B as it is."""
    if shard is not None or not isinstance(layer, MergedLinear):
        return {shard: b}
    parts = {}
    for i, part in enumerate(b.split(layer.full_sizes)):
        piece = layer.checkpoint_slice(i)
        parts[i] = part if piece is None else part[piece[1]:piece[1] + piece[2]]
    return parts


def _full_sizes(layer: Linear, shard: int | None) -> tuple[int, int]:
    """(output rows, input columns) of the checkpoint's weight for this projection."""
    if isinstance(layer, MergedLinear):
        out = layer.full_sizes[shard] if shard is not None else sum(layer.full_sizes)
    elif isinstance(layer, ColumnParallelLinear):
        out = layer.full_out
    else:
        out = layer.out_features
    cols = layer.in_features * (layer.tp.size if isinstance(layer, RowParallelLinear) else 1)
    return out, cols


def _checked_pair(a_slice: Any, b_slice: Any, layer: Linear, shard: int | None, module: str,
                  where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B read (this rank's part only) after their shapes are checked."""
    a_shape, b_shape = list(a_slice.get_shape()), list(b_slice.get_shape())
    out, cols = _full_sizes(layer, shard)
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
        raise LoRAError(f"{where}: module {module!r}: lora_A {a_shape} and lora_B {b_shape} "
                        "are not a low-rank pair.")
    r = a_shape[0]
    if a_shape[1] != cols or b_shape[0] != out:
        raise LoRAError(f"{where}: module {module!r}: lora_A {a_shape} / lora_B {b_shape} do "
                        f"not fit the base layer ({out} x {cols}, expects lora_A [{r}, {cols}]"
                        f" and lora_B [{out}, {r}]): an adapter of another base model?")
    piece = layer.checkpoint_slice(shard)
    if piece is None or (shard is None and isinstance(layer, MergedLinear)):
        return a_slice[:], b_slice[:]  # (a whole merged layer: cut by _by_projection)
    dim, start, size = piece
    if dim == 0:  # (this rank's output rows: B's rows)
        kept = max(0, min(size, out - start))
        b = torch.zeros(size, r, dtype=_dtype(b_slice))
        b[:kept] = b_slice[start:start + kept]
        return a_slice[:], b
    return a_slice[:, start:start + size], b_slice[:]  # (this rank's input columns: A's)


def _dtype(lazy: Any) -> torch.dtype:
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "F64": torch.float64}.get(lazy.get_dtype(), torch.float32)
