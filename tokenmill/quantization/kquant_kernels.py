"""GGUF Q4_K and Q6_K weights served at about their stored size (csrc/kquant_panels.c): the
K-quants' 6-bit / 8-bit group scales and float32 factors per 256 inputs kept as they are, not
widened to a float scale per group (the int4 / int8 kernels' 5 and 10 bits a weight against
the file's 4.5 and 6.6).

A checkpoint layout (row-major, one row per output channel; what `tensors` gives and a
tensor-parallel rank cuts): Q4_K `qweight` [N, K/2] (byte j: inputs 2j low, 2j + 1 high
nibble, q 0..15), `sc` / `mn` [N, K/32] u8, `d` / `dmin` [N, K/256] float32, the weight
d sc q - dmin mn; Q6_K `qweight` [N, K/2] (the low four bits of q 0..63), `qhigh` [N, K/4]
(bits 2t, 2t + 1 of byte i: the high two bits of input 4i + t), `sc` [N, K/16] int8, `d`
[N, K/256], the weight d sc (q - 32). With the compiled kernels the layer keeps only its
panels (one blob) and the checkpoint layout is read back from them on demand."""

from __future__ import annotations

import torch

from tokenmill import csrc
from tokenmill.quantization.linear_kernels import QuantizedKernel


def _nibbles(pairs: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] values: input 2j the low nibble of byte j, 2j + 1 the high."""
    return torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)


def _spread(factor: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """A factor per 256 inputs for each of `groups`' columns (a tensor-parallel rank whose
    inputs lie inside one 256-block has that block's factor for all of them)."""
    return factor.float().repeat_interleave(groups.shape[1] // factor.shape[1], dim=1)


class _KQuantKernel(QuantizedKernel):
    """What Q4KKernel and Q6KKernel share; each has its `_weight(tensors)`: the float weight
    of (some rows of) the checkpoint layout."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.out_features = tensors["qweight"].shape[0]
        self.k = tensors["qweight"].shape[1] * 2
        self.fast = self._on_fast_cpu() and self.k % 256 == 0
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
        kind = csrc.Q6K if self.method == "q6k" else csrc.Q4K
        return csrc.LinearForm(kind, 0, 2**31 - 1, self.blob.data_ptr())


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
