"""Checkpoints stored as float8 weights with one scale per block of weights (DeepSeek-V3 /
R1's and Qwen3's FP8 releases: `quantization_config` {"quant_method": "fp8",
"weight_block_size": [128, 128]}, each `X.weight` in float8_e4m3fn beside its
`X.weight_scale_inv`, the factor of each 128 x 128 block). They load as the float weights
they stand for (w = fp8 x its block's factor), which the engine serves as any float
checkpoint, or quantizes again with --quantization."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.layers.linear import CheckpointSlice

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


def dequantized(names: list[str], get_slice, block: tuple[int, int], lazy: bool):
    """(name, tensor, or with `lazy` a CheckpointSlice) for one safetensors file's `names`
    (`get_slice` opens one): float8 weights dequantized, their block factors consumed."""
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
        stored = Fp8BlockSlice(sliced, scale, block)
        yield name, stored if lazy else stored.read()
