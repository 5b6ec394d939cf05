"""MXFP4 (OCP microscaling FP4, as gpt-oss ships its experts): each 4-bit E2M1 value (0,
±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6) times two is a whole number from -12 to 12, and each block of
32 shares one power of two (its scale byte minus 127), so int8 values with a float32 scale
per 32 inputs hold the same weights bit for bit: the checkpoint form (`mxfp4_int8`), which
the int8 kernel serves anywhere. `Mxfp4Kernel` keeps them as 4-bit codes on VNNI CPUs.
`dequantize_mxfp4` is the slow, obvious reading beside both (tests compare them)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tokenmill import csrc
from tokenmill.layers.linear import whole
from tokenmill.quantization.linear_kernels import Int8Kernel
from tokenmill.quantization.schemes import QuantizedShard, dequantize_int8

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
    """One [out, in] weight's MXFP4 blocks as the int8 kernel's tensors (`Mxfp4Kernel`
    serves them): qweight int8 (twice each value) and scale float32 [out, in / 32] (half
    each block's power of two)."""
    qweight = _TWICE[_codes(blocks)]
    scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32).float() - 128.0)
    return QuantizedShard("mxfp4", {"qweight": qweight.contiguous(), "scale": scale})


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


# doubled E2M1 value (-12..12) -> its code
_CODE_OF = torch.zeros(25, dtype=torch.uint8)
for _code, _value in enumerate(_TWICE.tolist()):
    if _code != 8:  # (-0: 0's code is 0)
        _CODE_OF[_value + 12] = _code


class Mxfp4Kernel(Int8Kernel):
    """MXFP4 weights as the int8 kernel holds them (each value times two, a float32 power
    of two per 32 inputs: `tensors`, what a checkpoint stores), kept on CPUs with AVX-512
    VNNI as E2M1 codes in csrc/vnni_panels.c's int4 panels with bfloat16 scales (4.5 bits a
    weight, against 9 for the int8 panels) and multiplied by the fp4 panel kernel, which
    gives the int8 panels' sums exactly. Elsewhere it is the int8 kernel."""

    method = "mxfp4"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)  # (its panels: `_to_panels`, fp4 ones for groups of 32)
        self.fp4 = self.vnni and self.group == BLOCK
        if self.fp4:
            self.name = "mxfp4-cpu-vnni"

    def _to_panels(self, tensors):
        if self.group == BLOCK:
            return _fp4_panels(tensors["qweight"], tensors["scale"])
        return super()._to_panels(tensors)

    def _from_panels(self):
        if not self.fp4:
            return super()._from_panels()
        wp, sp = self.panels
        rows = _codes_of_panels(wp)[:self.out_features]
        scale = sp.view(torch.bfloat16).permute(0, 2, 1).reshape(-1, sp.shape[1])
        return {"qweight": _TWICE[rows.long()], "scale": scale[:self.out_features].float()}

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.fp4:
            return super().rows(ids)
        tensors = self._from_panels()
        return dequantize_int8(tensors["qweight"][ids], tensors["scale"][ids])

    def _integer(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.fp4 and x.dim() == 2 and x.dtype == torch.float32:
            return csrc.fp4_vnni_gemm(x.contiguous(), *self.panels, self.out_features,
                                      layer.bias)
        return super()._integer(layer, x)

    def compiled_form(self) -> csrc.LinearForm | None:
        return None if self.fp4 else super().compiled_form()


# where input 8q + r of a channel sits in its panel word: bit 4 * (r // 2) + 16 * (r % 2)
_SHIFTS = torch.tensor([4 * (r // 2) + 16 * (r % 2) for r in range(8)], dtype=torch.int32)


def _fp4_panels(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """int8 doubled E2M1 values [N, K] and float32 scales [N, K/32] -> codes in the fp4
    panels (int32 words [ceil(N/16), K/8, 16]: 8 inputs of one channel each, laid out as
    `_SHIFTS` says; csrc/vnni_panels.c) and bfloat16 panel scales ([ceil(N/16), K/32, 16]);
    channels past N are zero."""
    n, k = qweight.shape
    panels = -(-n // 16)
    codes = torch.zeros(panels * 16, k, dtype=torch.uint8)
    codes[:n] = _CODE_OF[qweight.long() + 12]
    eights = codes.view(panels, 16, k // 8, 8)
    words = torch.zeros(panels, 16, k // 8, dtype=torch.int64)  # (a bit past int32's top)
    for r, shift in enumerate(_SHIFTS.tolist()):
        words |= eights[..., r].long() << shift
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # as int32's bits
    wp = words.to(torch.int32).permute(0, 2, 1).contiguous()
    scales = torch.zeros(panels * 16, k // BLOCK, dtype=torch.bfloat16)
    scales[:n] = scale.to(torch.bfloat16)
    sp = scales.view(panels, 16, -1).permute(0, 2, 1).contiguous()
    return wp, sp.view(torch.int16)


def _codes_of_panels(wp: torch.Tensor) -> torch.Tensor:
    """The fp4 panels' codes [ceil(N/16) * 16, K] (`_fp4_panels` undone)"""
    eights = (wp.unsqueeze(-1) >> _SHIFTS) & 15  # [P, K/8, 16, 8]
    return eights.permute(0, 2, 1, 3).reshape(wp.shape[0] * 16, -1)
