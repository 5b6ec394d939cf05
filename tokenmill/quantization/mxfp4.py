"""MXFP4 (OCP microscaling FP4, as gpt-oss ships its experts) read into the int8 kernel
exactly: each 4-bit E2M1 value (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6) times two is a whole
number from -12 to 12, and each block of 32 shares one power of two (its scale byte minus
127), so int8 values with a float32 scale per 32 inputs hold the same weights bit for bit.
`dequantize_mxfp4` is the slow, obvious reading beside it (tests compare the two)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tokenmill.layers.linear import whole
from tokenmill.quantization.schemes import QuantizedShard

BLOCK = 32  # values per scale
MXFP4_PARTS = ("_blocks", "_scales")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_TWICE = torch.tensor([int(2 * v) for v in E2M1], dtype=torch.int8)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] bytes -> [..., G * 32] 4-bit codes, each byte's low nibble first."""
    blocks = blocks.to(torch.uint8)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)
    return codes.reshape(*blocks.shape[:-2], -1).long()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weights [..., G * 32] of MXFP4 `blocks` [..., G, 16] and `scales`
    [..., G]: value * 2 ** (scale - 127)."""
    values = torch.tensor(E2M1, dtype=torch.float32)[_codes(blocks)]
    exponents = scales.to(torch.int32) - 127
    grouped = values.view(*values.shape[:-1], -1, BLOCK)
    return torch.ldexp(grouped, exponents.unsqueeze(-1).float()).reshape(values.shape)


def mxfp4_int8(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedShard:
    """One [out, in] weight's MXFP4 blocks as the int8 kernel's tensors: qweight int8 (twice
    each value) and scale float32 [out, in / 32] (half each block's power of two)."""
    qweight = _TWICE[_codes(blocks)]
    scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32).float() - 128.0)
    return QuantizedShard("int8", {"qweight": qweight.contiguous(), "scale": scale})


def mxfp4_experts(weights: Iterable[tuple[str, Any]], model: Any
                  ) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors with each layer's stacked MXFP4 experts (`X_blocks` and
    `X_scales`, [experts, out, ...]) as one int8 kernel shard per expert this rank holds,
    `model.layers.N.mlp.experts.E.X.weight`, once both halves came; the rest as they come."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        part = next((p for p in MXFP4_PARTS if name.endswith(p)), None)
        if part is None:
            yield name, tensor
            continue
        stem = name[: -len(part)]  # model.layers.N.mlp.experts.X
        halves = pending.setdefault(stem, {})
        halves[part] = whole(tensor)
        if len(halves) < 2:
            continue
        del pending[stem]
        prefix, kind = stem.rsplit(".experts.", 1)
        moe = model.model.layers[int(prefix.split(".")[2])].mlp
        blocks, scales = halves["_blocks"], halves["_scales"]
        for e in range(blocks.shape[0]):
            if moe.holds_expert(e):
                yield f"{prefix}.experts.{e}.{kind}.weight", mxfp4_int8(blocks[e], scales[e])
    if pending:
        raise ValueError(f"MXFP4 experts without their other half: {sorted(pending)}.")
