"""GGUF Q4_K, Q6_K, Q5_0 and Q5_1 weights served at about their stored size
(csrc/kquant_panels.c): the K-quants' 6-bit / 8-bit group scales and float32 factors per 256
inputs kept as they are, not widened to a float scale per group (the int4 / int8 kernels' 5
and 10 bits a weight against the file's 4.5 and 6.6), and Q5's fifth bits in a plane of
their own (int8 would take 9 bits against 5.5).

A checkpoint layout (row-major, one row per output channel; what `tensors` gives and a
tensor-parallel rank cuts): Q4_K `qweight` [N, K/2] (byte j: inputs 2j low, 2j + 1 high
nibble, q 0..15), `sc` / `mn` [N, K/32] u8, `d` / `dmin` [N, K/256] float32, the weight
d sc q - dmin mn; Q6_K `qweight` [N, K/2] (the low four bits of q 0..63), `qhigh` [N, K/4]
(bits 2t, 2t + 1 of byte i: the high two bits of input 4i + t), `sc` [N, K/16] int8, `d`
[N, K/256], the weight d sc (q - 32); Q5_0 / Q5_1 `qweight` (the low four bits of q 0..31,
as Q4_K's), `qbit` [N, K/8] (bit s of byte i: the fifth bit of input 8i + s), `d` (and Q5_1's
`m`) [N, K/32] float16, the weight d (q - 16) (Q5_1: d q + m). With the compiled kernels the
layer keeps only its panels (one blob) and the checkpoint layout is read back from them on
demand."""

from __future__ import annotations

import torch

from tokenmill import csrc
from tokenmill.csrc.kquant import KQUANT_INPUTS
from tokenmill.quantization.linear_kernels import QuantizedKernel


def _nibbles(pairs: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] values: input 2j the low nibble of byte j, 2j + 1 the high."""
    return torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)


def _spread(factor: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """A factor per 256 inputs for each of `groups`' columns (a tensor-parallel rank whose
    inputs lie inside one 256-block has that block's factor for all of them)."""
    return factor.float().repeat_interleave(groups.shape[1] // factor.shape[1], dim=1)


class _KQuantKernel(QuantizedKernel):
    """What the kernels of this module share; each has its `_weight(tensors)`: the float
    weight of (some rows of) the checkpoint layout."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.out_features = tensors["qweight"].shape[0]
        self.k = tensors["qweight"].shape[1] * 2
        self.fast = self._on_fast_cpu() and self.k % KQUANT_INPUTS[self.method] == 0
        self.blob = csrc.kquant_blob(self.method, tensors) if self.fast else None
        if self.blob is not None:  # the panels replace the checkpoint layout: one copy
            self._tensors = None
        self.name = f"{self.method}-cpu" if self.fast else f"{self.method}-dequant"

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is not None:
            return self._tensors
        return csrc.kquant_rows(self.method, self.blob, self.k,
                                torch.arange(self.out_features))

    @tensors.setter
    def tensors(self, value: dict[str, torch.Tensor]) -> None:
        self._tensors = value

    def weight_bytes(self) -> int:
        if self.blob is not None:
            return self.blob.numel()
        return super().weight_bytes()

    def dequantize(self) -> torch.Tensor:
        return self._weight(self.tensors)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blob is None:
            return self._weight({leaf: t[ids] for leaf, t in self.tensors.items()})
        return self._weight(csrc.kquant_rows(self.method, self.blob, self.k, ids))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.fast and x.dim() == 2 and x.dtype == torch.float32:
            return csrc.kquant_gemm(self.method, x.contiguous(), self.blob, self.out_features,
                                    layer.bias)
        return self.reference(layer, x)

    def compiled_form(self) -> csrc.LinearForm | None:
        if self.blob is None:
            return None
        return csrc.LinearForm(csrc.KQUANT, csrc.KQUANT_KINDS[self.method], 2**31 - 1,
                               self.blob.data_ptr())


class Q4KKernel(_KQuantKernel):
    method = "q4k"

    @staticmethod
    def _weight(t: dict[str, torch.Tensor]) -> torch.Tensor:
        q = _nibbles(t["qweight"]).float()
        n, k = q.shape
        scale = _spread(t["d"], t["sc"]) * t["sc"].float()
        mins = _spread(t["dmin"], t["mn"]) * t["mn"].float()
        return (q.view(n, -1, 32) * scale[..., None] - mins[..., None]).view(n, k)


class Q6KKernel(_KQuantKernel):
    method = "q6k"

    @staticmethod
    def _weight(t: dict[str, torch.Tensor]) -> torch.Tensor:
        low = _nibbles(t["qweight"])
        high = t["qhigh"]
        high = torch.stack([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).reshape(low.shape)
        q = ((low | (high << 4)).to(torch.int16) - 32).float()
        n, k = q.shape
        scale = _spread(t["d"], t["sc"]) * t["sc"].float()
        return (q.view(n, -1, 16) * scale[..., None]).view(n, k)


def q5_servable(method: str, tensors: dict[str, torch.Tensor], widen: bool = False
                ) -> tuple[str, dict[str, torch.Tensor]]:
    """Q5 weights as the kernels take them: kept unless `widen` (TOKENMILL_GGUF_COMPACT=0) or
    their rows (a tensor-parallel rank's cut of them too) are no multiple of the kernel's 64
    inputs; then int8 groups of 32, exactly (Q5_1: q 0..31 with a float offset per group)."""
    k = tensors["qweight"].shape[1] * 2
    if method not in ("q5_0", "q5_1") or not (widen or k % KQUANT_INPUTS[method]):
        return method, tensors
    q = _fifth_bits(tensors).to(torch.int16)
    out = {"qweight": (q - 16 if method == "q5_0" else q).to(torch.int8),
           "scale": tensors["d"].float()}
    if method == "q5_1":
        out["offset"] = tensors["m"].float()
    return "int8", out


def _fifth_bits(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Q5's values q (0..31) [N, K] of its nibbles and fifth bits."""
    bits = (t["qbit"][..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return _nibbles(t["qweight"]) | (bits.reshape(bits.shape[0], -1) << 4)


class Q50Kernel(_KQuantKernel):
    method = "q5_0"

    @staticmethod
    def _weight(t: dict[str, torch.Tensor]) -> torch.Tensor:
        q = _fifth_bits(t).float() - 16
        n, k = q.shape
        return (q.view(n, -1, 32) * t["d"].float()[..., None]).view(n, k)


class Q51Kernel(_KQuantKernel):
    method = "q5_1"

    @staticmethod
    def _weight(t: dict[str, torch.Tensor]) -> torch.Tensor:
        q = _fifth_bits(t).float()
        n, k = q.shape
        return (q.view(n, -1, 32) * t["d"].float()[..., None]
                + t["m"].float()[..., None]).view(n, k)
