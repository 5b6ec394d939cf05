"""Quantization applied to a whole model: switch its `Linear` layers to quantized kernels, from
float weights (quantize at load), from a `tokenmill quantize` checkpoint's tensors, or from
GGUF's quantized blocks; and the other way, the tensors a quantized checkpoint stores."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.config.quantization import QuantConfig
from tokenmill.layers.linear import DenseKernel, Linear, MergedLinear, materialized, whole
from tokenmill.layers.norm import RMSNorm
from tokenmill.quantization.activation_kernels import A8W8Kernel, Fp8Kernel
from tokenmill.quantization.calibration import ActivationStats
from tokenmill.quantization.fp8_blocks import Fp8BlockKernel
from tokenmill.quantization.kquant_kernels import (
    Q4KKernel,
    Q6KKernel,
    Q50Kernel,
    Q51Kernel,
    q5_servable,
)
from tokenmill.quantization.linear_kernels import (
    Int4Kernel,
    Int8Kernel,
    PartsKernel,
    QuantizedKernel,
)
from tokenmill.quantization.mxfp4 import Mxfp4Kernel
from tokenmill.quantization.schemes import QuantizedShard, smoothing_factors

logger = logging.getLogger(__name__)

# quantization method -> the kernel that serves it
KERNELS = {cls.method: cls for cls in (Int8Kernel, Int4Kernel, A8W8Kernel, Fp8Kernel,
                                       Q4KKernel, Q6KKernel, Q50Kernel, Q51Kernel,
                                       Fp8BlockKernel, Mxfp4Kernel)}
# methods whose `qweight` holds two inputs a byte
_NIBBLES = ("int4", "q4k", "q6k", "q5_0", "q5_1")

# Leaf names of the tensors quantized kernels keep (a checkpoint stores `<layer>.<leaf>`).
KERNEL_TENSORS = frozenset({"qweight", "scale", "min", "smooth", "act_range", "act_scale"})


def quantizable_linears(model: nn.Module, config: QuantConfig) -> list[tuple[str, Linear]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, Linear) and isinstance(module.kernel, DenseKernel)
            and (config.lm_head or name != "lm_head")
            and not module.keep_float  # (a MoE router)
            and not module.keep_weight]  # (MLA's kv_b_proj)


def make_kernel(weight: torch.Tensor, config: QuantConfig,
                stats: ActivationStats | None = None, method: str | None = None,
                row_absmax: torch.Tensor | None = None) -> QuantizedKernel:
    """`row_absmax`: the whole rows' absolute maxima where `weight` is a tensor-parallel
    rank's slice of the inputs, so per-channel scales are those of the unsplit layer."""
    method = method or config.method
    if method == "int8":
        return Int8Kernel.from_weight(weight, None if config.method == "int4"
                                      else config.group_size, row_absmax)
    if method == "int4":
        return Int4Kernel.from_weight(weight, config.group_size)
    if method == "a8w8":
        smooth = None if stats is None else smoothing_factors(stats.absmax, weight,
                                                              config.smoothquant_alpha)
        act_range = None
        if config.activation == "static":
            if stats is None:
                raise ValueError("a8w8 with static activations needs calibration data.")
            s = torch.ones_like(stats.low) if smooth is None else smooth
            act_range = torch.stack([(stats.low / s).min(), (stats.high / s).max()])
        return A8W8Kernel.from_weight(weight, smooth, act_range,
                                      None if smooth is not None else row_absmax)
    if config.activation == "static" and stats is None:
        raise ValueError("fp8 with static activations needs calibration data.")
    return Fp8Kernel.from_weight(weight, config.fp8_per_channel,
                                 None if config.activation == "dynamic" else stats.absmax.max(),
                                 row_absmax)


def quantize_linears(model: nn.Module, config: QuantConfig,
                     stats: dict[str, ActivationStats] | None = None,
                     progress: bool = False) -> int:
    """Quantize every dense `Linear` (the LM head too unless `config.lm_head` is False) in
    place. Returns how many layers were quantized."""
    layers = quantizable_linears(model, config)
    for name, module in tqdm(layers, desc=f"quantizing ({config.method})", disable=not progress):
        try:
            kernel = make_kernel(module.weight.detach(), config, (stats or {}).get(name),
                                 config.layer_method(name),
                                 getattr(module, "row_absmax", None))
        except ValueError as exc:
            raise ValueError(f"Cannot quantize {name} with {config.method}: {exc}") from None
        module.use_kernel(kernel)
    return len(layers)


def load_kernels(model: nn.Module, config: QuantConfig,
                 tensors: dict[str, dict[str, torch.Tensor]]) -> set[str]:
    """Give each layer named in `tensors` (layer -> leaf -> tensor, as a checkpoint stores
    them) its quantized kernel, cut to this tensor-parallel rank's part. Returns the float
    weights this replaces."""
    modules = dict(model.named_modules())
    replaced = set()
    for name, leaves in tensors.items():
        module = modules.get(name)
        if not isinstance(module, Linear):
            raise ValueError(f"Checkpoint has quantized tensors for {name!r}, which is not a "
                             "linear layer of this model.")
        try:
            part = rank_part(module, leaves)
        except ValueError as exc:
            raise ValueError(f"Cannot split {name} across tensor-parallel ranks: {exc}") from None
        # (a checkpoint's tensors are read to the host; the kernel runs on the layer's device)
        module.use_kernel(KERNELS[config.layer_method(name)](_on(part, module.device)))
        replaced.add(f"{name}.weight")
    return replaced


# Leaves that run along a layer's inputs only (SmoothQuant's factors), and the scalars every
# rank keeps whole (static activation ranges and scales).
_INPUT_LEAVES = frozenset({"smooth"})
_WHOLE_LEAVES = frozenset({"act_range", "act_scale"})


def rank_part(layer: Linear, leaves: dict[str, object]) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's part of the tensors `tokenmill quantize` stored for the
    whole `layer` (`CheckpointSlice`s read only that part). Output channels: every tensor
    with a row per channel (merged layers: each projection's rows); input channels: the
    weight's columns and whole quantization groups, a group never split across ranks."""
    rows = [layer.checkpoint_slice()] if not isinstance(layer, MergedLinear) else [
        layer.checkpoint_slice(i) for i in range(len(layer.full_sizes))]
    if all(part is None for part in rows):
        return {leaf: whole(t) for leaf, t in leaves.items()}
    if rows[0][0] == 1:  # row-parallel: a slice of the inputs
        _, start, size = rows[0]
        k = layer.in_features * layer.tp.size
        return {leaf: _input_part(leaf, t, start, size, k) for leaf, t in leaves.items()}
    full = layer.full_sizes if isinstance(layer, MergedLinear) else [layer.full_out]
    offsets = [sum(full[:i]) for i in range(len(full))]
    spans = [(offset + start, size) for offset, (_, start, size) in zip(offsets, rows)]
    return {leaf: _output_part(t, spans, sum(full)) for leaf, t in leaves.items()}


def _output_part(tensor, spans: list[tuple[int, int]], out: int) -> torch.Tensor:
    if tensor.dim() == 0 or tensor.shape[0] != out:  # per tensor, or along the inputs
        return whole(tensor)
    pieces = []
    for start, size in spans:
        kept = max(0, min(size, out - start))  # rows past the end: an LM head's zero padding
        piece = tensor.narrow(0, start, kept)
        if kept < size:
            pad = torch.zeros((size - kept, *piece.shape[1:]), dtype=piece.dtype)
            piece = torch.cat([piece, pad])
        pieces.append(piece)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()


def _input_part(leaf: str, tensor, start: int, size: int, k: int) -> torch.Tensor:
    if leaf in _WHOLE_LEAVES:
        return whole(tensor)
    if leaf in _INPUT_LEAVES:
        return tensor.narrow(0, start, size).contiguous()
    if tensor.dim() < 2 or (leaf != "qweight" and tensor.shape[1] == 1):
        return whole(tensor)  # one scale per output channel (of the whole row)
    columns = tensor.shape[1]  # the weight's (int4: two inputs a byte), or groups a row
    if leaf == "qweight":
        return tensor.narrow(1, start * columns // k, size * columns // k).contiguous()
    group = k // columns
    if start % group == 0 and size % group == 0:  # whole groups
        return tensor.narrow(1, start // group, size // group).contiguous()
    if group % size == 0 and size % 32 == 0:  # the rank's inputs lie inside one group
        return tensor.narrow(1, start // group, 1).contiguous()
    raise ValueError(f"its quantization groups of {group} inputs do not split into "
                     f"{k // size} parts of {size} inputs: quantize with a --group-size "
                     "that divides them, or serve with another tensor-parallel size.")


def narrow_shard(shard: QuantizedShard, part: tuple[int, int, int] | None,
                 rows: int) -> QuantizedShard | None:
    """A tensor-parallel rank's part (dim, start, size) of a weight kept quantized, cut as
    `rank_part` cuts a stored layer (None where the part would split a group: dequantize;
    Q5 widened to int8 where the part's inputs are no multiple of its kernel's)."""
    if part is None:  # (tensors not read yet are read whole)
        return QuantizedShard(shard.method, {leaf: whole(t) for leaf, t in shard.tensors.items()})
    dim, start, size = part
    if dim == 0:
        return QuantizedShard(shard.method, {leaf: _output_part(t, [(start, size)], rows)
                                             for leaf, t in shard.tensors.items()})
    k = shard.tensors["qweight"].shape[1] * (2 if shard.method in _NIBBLES else 1)
    try:
        return QuantizedShard(*q5_servable(shard.method, {
            leaf: _input_part(leaf, t, start, size, k) for leaf, t in shard.tensors.items()}))
    except ValueError:
        return None


def load_shards(model: nn.Module, shards: dict[str, dict[int | None, QuantizedShard]]
                ) -> set[str]:
    """GGUF weights kept quantized: each shard cut to this tensor-parallel rank's part, the
    shards of one layer (q|k|v, gate|up) concatenated by rows when they share a format, each
    served by its own kernel when they do not (`PartsKernel`); a layer whose part splits a
    block, or whose other shards came as float, is dequantized instead."""
    modules = dict(model.named_modules())
    replaced = set()
    for name in list(shards):
        # (taken out as it is used: a layer's blocks are freed once its kernel holds them,
        # not all at the end; the joined copies would otherwise double the peak)
        by_index = shards.pop(name)
        module = modules[name]
        if None in by_index and hasattr(module, "full_sizes"):  # one fused q|k|v / gate|up
            fused = by_index.pop(None)  # (Phi-3's): its projections' rows, in order
            by_index.update(enumerate(QuantizedShard(fused.method, dict(zip(
                fused.tensors, parts))) for parts in zip(*(
                    t.split(module.full_sizes) for t in fused.tensors.values()))))
        merged = len(by_index) > 1 or hasattr(module, "shards")
        indices = sorted(by_index)
        parts = [narrow_shard(by_index[i], module.checkpoint_slice(i if merged else None),
                              _shard_rows(by_index[i])) for i in indices]
        every = not isinstance(module, MergedLinear) or len(parts) == len(module.full_sizes)
        # (a layer whose float weight is read directly, as MLA's kv_b_proj, or kept float)
        every = every and not (module.keep_weight or module.keep_float)
        same = every and all(p is not None for p in parts) and all(
            p.method == parts[0].method and p.tensors.keys() == parts[0].tensors.keys()
            and all(t.shape[1:] == parts[0].tensors[leaf].shape[1:]
                    for leaf, t in p.tensors.items()) for p in parts)
        if same:
            method = parts[0].method
            joined = {leaf: parts[0].tensors[leaf] if len(parts) == 1 else
                      torch.cat([p.tensors[leaf] for p in parts]) for leaf in parts[0].tensors}
            # (the parts go before the kernel repacks the joined copy: one copy less at the
            # load's peak)
            parts.clear()
            by_index.clear()
            module.use_kernel(KERNELS[method](_on(joined, module.device)))
        elif every and merged and all(p is not None for p in parts):
            # formats differ (llama.cpp's Q4_K_M: v in Q6_K beside Q4_K q and k): a kernel each
            module.use_kernel(PartsKernel([KERNELS[p.method](_on(p.tensors, module.device))
                                           for p in parts], module.output_sizes))
        else:  # float, through the layer's own loaders (they cut this rank's part)
            param = materialized(module)
            for i in indices:
                tensors = {leaf: whole(t) for leaf, t in by_index[i].tensors.items()}
                weight = KERNELS[by_index[i].method](tensors).dequantize()
                if merged:
                    param.weight_loader(param, weight, i)
                else:
                    param.weight_loader(param, weight)
        replaced.add(f"{name}.weight")
    return replaced


def _on(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {leaf: t.to(device) for leaf, t in tensors.items()}


def _shard_rows(shard: QuantizedShard) -> int:
    return shard.tensors["qweight"].shape[0]


def split_checkpoint(weights: Iterable[tuple[str, object]], target_of,
                     quantized: dict[str, dict[str, torch.Tensor]],
                     shards: dict[str, dict[int | None, QuantizedShard]],
                     on_shard=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass float tensors on; keep quantized ones aside, by layer: kernel tensors of a
    tokenmill checkpoint into `quantized`, GGUF shards into `shards` (`target_of` maps a
    checkpoint name to the model's parameter and shard index; `on_shard(layer)` is told of
    each shard as it is kept)."""
    for name, tensor in weights:
        if isinstance(tensor, QuantizedShard):
            target, shard = target_of(name)
            layer = target.rpartition(".")[0]
            shards.setdefault(layer, {})[shard] = tensor
            if on_shard is not None:
                on_shard(layer)
            continue
        layer, _, leaf = name.rpartition(".")
        if leaf in KERNEL_TENSORS:
            quantized.setdefault(layer, {})[leaf] = tensor
            continue
        yield name, tensor


def quantized_state_dict(model: nn.Module,
                         checkpoint_norms: bool = False) -> dict[str, torch.Tensor]:
    """Everything a quantized checkpoint stores, under the model's own parameter names:
    quantized layers as their kernel tensors, the rest as parameters (tied ones once);
    `checkpoint_norms`: norms as the checkpoint holds them (a file read back through the
    weight loaders; a pre-sharded rank file is copied in as it is)."""
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) not in seen:
            seen.add(id(param))
            state[name] = param.detach().contiguous()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and isinstance(module.kernel, QuantizedKernel):
            for leaf, tensor in module.kernel.tensors.items():
                state[f"{name}.{leaf}"] = tensor.contiguous()
        elif checkpoint_norms and isinstance(module, RMSNorm) and module.checkpoint_offset:
            state[f"{name}.weight"] = module.weight.detach() - module.checkpoint_offset
    return state


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as they sit in memory (quantized tensors, float parameters, each
    shared tensor once; CPU-packed fp32 layers count their packed copy)."""
    total, seen = 0, set()
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is None:
            total += module.kernel.weight_bytes()
    return total
