"""Checkpoints stored as float8 weights with one scale per block of weights (DeepSeek-V3 /
R1's and Qwen3's FP8 releases: `quantization_config` {"quant_method": "fp8",
"weight_block_size": [128, 128]}, each `X.weight` in float8_e4m3fn beside its
`X.weight_scale_inv`, the factor of each 128 x 128 block).

On GPUs (TOKENMILL_FP8_BLOCKS=auto) the float8 weights are kept as they are, one byte a
weight, served weight-only by `Fp8BlockKernel` (DeepSeek-R1's 671 B parameters then take
~700 GB, not the 1.3 TB of bf16); each block's factor is repeated for its rows, so that a
layer's rows are self-contained: merged projections (q|k|v, gate|up) concatenate and
tensor-parallel ranks cut rows or whole groups of inputs as for any grouped weight
(quantization/model.py). On CPUs, or where a layer's inputs do not split into whole groups of
a multiple of 32 (or the layer reads its float weight, as MLA's kv_b_proj), they load as the
float weights they stand for (w = fp8 x its block's factor), which the engine serves as any
float checkpoint, or quantizes again with --quantization."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.layers.linear import CheckpointSlice
from tokenmill.quantization import schemes
from tokenmill.quantization.linear_kernels import TensorKernel

SCALE_SUFFIX = "_scale_inv"


def block_size(hf_config: Any) -> tuple[int, int] | None:
    """(rows, columns) of a weight block for such a checkpoint, else None."""
    data = getattr(hf_config, "quantization_config", None)
    if not isinstance(data, dict) or data.get("quant_method") != "fp8":
        return None
    size = data.get("weight_block_size")
    if not size or len(size) != 2:
        raise ValueError("This FP8 checkpoint has no `weight_block_size`: only block-scaled "
                         "FP8 checkpoints (weight_scale_inv per block) are read.")
    return int(size[0]), int(size[1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               first_row: int = 0, first_column: int = 0) -> torch.Tensor:
    """The float32 weights of `weight` (a part of the stored tensor starting at
    `first_row`, `first_column`), each times its block's factor in `scale`."""
    rows = (torch.arange(weight.shape[0]) + first_row) // block[0]
    columns = (torch.arange(weight.shape[1]) + first_column) // block[1]
    return weight.float() * scale.float()[rows][:, columns]


class Fp8BlockSlice(CheckpointSlice):
    """A stored float8 weight not read yet: a tensor-parallel rank reads only its rows or
    columns, dequantized with their blocks' factors."""

    def __init__(self, lazy, scale: torch.Tensor, block: tuple[int, int]) -> None:
        super().__init__(lazy)
        self._scale, self._block = scale, block

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        part = self._lazy[(slice(None),) * dim + (slice(start, start + length),)]
        return dequantize(part, self._scale, self._block, start if dim == 0 else 0,
                          start if dim == 1 else 0)

    def read(self) -> torch.Tensor:
        return dequantize(self._lazy[:], self._scale, self._block)


def row_scales(scale: torch.Tensor, block: tuple[int, int], rows: int) -> torch.Tensor:
    """Block factors [ceil(N / b0), K / b1] as one per row and group of b1 inputs [N, K / b1]."""
    return scale.float().repeat_interleave(block[0], dim=0)[:rows].contiguous()


def keepable(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Whether `Fp8BlockKernel` serves a weight of `shape`: its inputs in whole groups of a
    multiple of 32 (the Triton kernels' step)."""
    return len(shape) == 2 and block[1] % 32 == 0 and shape[1] % block[1] == 0


def dequantized(names: list[str], get_slice, block: tuple[int, int], lazy: bool,
                keep: bool = False):
    """(name, tensor, or with `lazy` a CheckpointSlice) for one safetensors file's `names`
    (`get_slice` opens one): float8 weights dequantized, their block factors consumed; with
    `keep`, those `keepable` come as `QuantizedShard`s of `Fp8BlockKernel`'s tensors."""
    from tokenmill.quantization.schemes import QuantizedShard

    present = set(names)
    for name in names:
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in present:
            continue
        sliced = get_slice(name)
        scale_name = name + SCALE_SUFFIX
        if sliced.get_dtype() != "F8_E4M3" or scale_name not in present:
            yield name, CheckpointSlice(sliced) if lazy else sliced[:]
            continue
        scale = get_slice(scale_name)[:]
        shape = tuple(sliced.get_shape())
        if keep and keepable(shape, block):
            # (read when its layer is loaded, this rank's part only: the host holds one
            # layer's bytes at a time, not the model's)
            yield name, QuantizedShard(Fp8BlockKernel.method, {
                "qweight": CheckpointSlice(sliced), "scale": row_scales(scale, block, shape[0])})
            continue
        stored = Fp8BlockSlice(sliced, scale, block)
        yield name, stored if lazy else stored.read()


class Fp8BlockKernel(TensorKernel):
    """Weight-only float8 e4m3 with a float32 scale per row and group of inputs (a block-FP8
    checkpoint's weights as stored, their block factors repeated per row): y = x @ (q x
    scale)^T in the activations' dtype. GPUs: quantization/triton_kernels.py's weight-only
    matmul for steps of up to `TRITON_MAX_ROWS` rows (decodes: the weights cross memory at one
    byte each); larger steps and CPUs dequantize the layer and multiply."""

    method = "fp8_block"
    # rows up to which the Triton kernel runs on a GPU (every decode graph's bucket, up to
    # 256 sequences: dequantizing a layer per step would read its bytes 3x over); larger
    # steps (prompts) dequantize and run on cuBLAS, as an untuned Triton tile is far from
    # cuBLAS where the products, not the weight bytes, bound the step (not yet measured)
    TRITON_MAX_ROWS = 256

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.out_features, k = tensors["qweight"].shape
        self.group = k // tensors["scale"].shape[1]
        self.triton = self._on_triton_gpu(k) and self.group % 32 == 0
        self.name = "fp8-block-triton" if self.triton else "fp8-block-dequant"
        self.fp8_read = None  # how the Triton kernel reads float8 on this card (once)
        if self.triton:
            from tokenmill.quantization.triton_kernels import fp8_mode

            self.fp8_read = fp8_mode(tensors["qweight"].device)

    # (int8's grouped arithmetic: q x its row's scale for its group of inputs)
    def dequantize(self) -> torch.Tensor:
        return schemes.dequantize_int8(self.qweight, self.scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return schemes.dequantize_int8(self.qweight[ids], self.scale[ids])

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.triton and x.dim() == 2 and x.shape[0] <= self.TRITON_MAX_ROWS:
            from tokenmill.quantization.triton_kernels import weight_only_matmul

            return weight_only_matmul(x, self.qweight, self.scale, None, layer.bias,
                                      self.group, self.fp8_read)
        return F.linear(x, self.dequantize().to(x.dtype), layer.bias)
