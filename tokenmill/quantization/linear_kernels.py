"""Weight-only quantized kernels for `Linear` (int8, int4; activation-quantized ones are in
activation_kernels.py): each holds its quantized tensors (the layer's float weight is
dropped) and multiplies by them. The fast path is picked once, at construction, from the device
(CPU: compiled AVX2 kernels / fbgemm; CUDA: Triton, `torch._scaled_mm`);
`reference()` is the plain dequantize-then-matmul path beside it, used where no fast kernel
exists and by the tests that check the fast path against it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from tokenmill import csrc
from tokenmill.config import kernels as kernel_switches
from tokenmill.quantization import schemes

# On CPUs without VNNI: rows above which the weight-only kernels unpack the weight into fp32
# panels and run the fp32 panel kernel (csrc/dequant_panels.c) instead of the integer kernels
# (which convert each weight once per 4 rows). The default model's 120 projections alone,
# Zen 4 before the VNNI panels (bench/NOTES.md):
# int8 Q8_0 equal at 24-32 rows, the panels 1.2x faster at 48-96 and 1.5x at 128-512; int4
# Q4_1 0.8x at 16 rows, 1.4x from 20. In a whole step the unpacking costs more than that (a
# 32-row q8_0 decode step layer by layer through the panels: ~150 ms instead of ~95, the LM
# head's 113 MB unpacked each step), so the limits stay where the integer kernels are still
# clearly behind: prompts and large batches take the panels.
INT8_MAX_ROWS = 128
INT4_MAX_ROWS = 64
# vnni_panels.c (VNNI CPUs) has no such limit: it is the fastest kernel at every row count.
VNNI_MAX_ROWS = 1 << 20


class QuantizedKernel(ABC):
    """Shared shape of the quantized kernels. `tensors` is what a checkpoint stores."""

    method = ""
    name = ""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.reference(layer, x)

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float weight [N, K] these tensors stand for."""

    def reference(self, layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize().to(x.dtype), layer.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float rows `ids` of the weight (a tied embedding's lookups in its LM head)."""
        return self.dequantize()[ids]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def apply_gated(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        """No fused silu(gate) * up pass (layers/linear.py's `DenseKernel.apply_gated`)."""
        return None

    def compiled_form(self) -> csrc.LinearForm | None:
        """The compiled decode step's description of this kernel; None where it has none."""
        return None

    def _on_fast_cpu(self) -> bool:
        first = next(iter(self.tensors.values()))
        return first.device.type == "cpu" and csrc.available()

    @staticmethod
    def _int_dot(k: int, group: int, groups_of_32_only: bool = False) -> bool:
        """Whether the compiled kernel rounds activations to int16 per 32 inputs and uses
        integer dot products (~2x faster at decode sizes, where the float-activation kernels
        spend their time converting weights to float; relative rounding ~1e-5)."""
        shape_ok = k % 32 == 0 and (group == 32 if groups_of_32_only else group % 32 == 0)
        return shape_ok and kernel_switches.current().cpu.int_dot

    def _on_triton_gpu(self, k: int) -> bool:
        first = next(iter(self.tensors.values()))
        return first.device.type == "cuda" and k % 32 == 0 and _triton_kernels() is not None


def _triton_kernels():
    try:
        from tokenmill.quantization import triton_kernels
    except ImportError:  # no triton installed
        return None
    return triton_kernels


class TensorKernel(QuantizedKernel):
    """A kernel whose `qweight` and `scale` are read through `tensors` (fused experts swap in
    views of their stacks; panel kernels unpack them on demand)."""

    @property
    def qweight(self) -> torch.Tensor:
        return self.tensors["qweight"]

    @property
    def scale(self) -> torch.Tensor:
        return self.tensors["scale"]


class _PanelKernel(TensorKernel):
    """A weight-only kernel that, on CPUs with AVX-512 VNNI, keeps its weight only as
    csrc/vnni_panels.c's panels (16 output channels, input pairs interleaved) and multiplies
    them at every row count: ~1.6x the fp32 panel kernel's rate at prompt sizes, and ahead of
    gemm.c's kernels from one row on (bench/NOTES.md). `tensors` (what a checkpoint stores)
    is then unpacked from the panels on demand."""

    def _keep(self, tensors: dict[str, torch.Tensor], vnni: bool) -> None:
        self.vnni = vnni
        if vnni:  # the panels replace the checkpoint layout: one copy in memory
            self.panels = self._to_panels(tensors)
            self._tensors = None
        else:
            self._tensors = tensors

    @abstractmethod
    def _to_panels(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The checkpoint tensors in vnni_panels.c's layout."""

    @abstractmethod
    def _from_panels(self) -> dict[str, torch.Tensor]:
        """The inverse of `_to_panels`."""

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self._from_panels() if self._tensors is None else self._tensors

    @tensors.setter
    def tensors(self, value: dict[str, torch.Tensor]) -> None:
        self._tensors = value

    def weight_bytes(self) -> int:
        if self.vnni:
            return sum(t.numel() * t.element_size() for t in self.panels)
        return super().weight_bytes()

    def _vnni_form(self, kind: int) -> csrc.LinearForm:
        return csrc.LinearForm(kind, self.group, VNNI_MAX_ROWS,
                               *(t.data_ptr() for t in self.panels))


class Int8Kernel(_PanelKernel):
    """Weight-only int8, symmetric per output channel (or per group, as GGUF Q8_0 stores).
    With VNNI the weight lives in panels (see `_PanelKernel`).

    An optional float32 `offset` per group (GGUF Q5_1 / Q5_K: w = q x scale + offset, q in
    0..31) is added as (x's sums per group) @ offset^T after the integer kernel; such a layer
    has no compiled decode form."""

    method = "int8"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        qweight, scale = tensors["qweight"], tensors["scale"].float()
        self.offset = tensors.get("offset")
        self.out_features, k = qweight.shape
        self.group = k // scale.shape[1]
        self.fast = self._on_fast_cpu() and self.group % 8 == 0
        self.int_dot = self.fast and self._int_dot(k, self.group)
        # (the Triton kernel reads one scale per 32 inputs)
        self.triton = self._on_triton_gpu(k) and self.group % 32 == 0
        offset = {} if self.offset is None else {"offset": self.offset}
        # the panels also take groups of 16 (GGUF Q6_K / Q3_K), which gemm.c's integer-dot
        # kernel does not
        panels = self.fast and (self.int_dot or (self.group == 16 and self._int_dot(k, 32)))
        self._keep({"qweight": qweight, "scale": scale, **offset},
                   panels and csrc.vnni_native())
        self.name = ("int8-cpu-vnni" if self.vnni else "int8-cpu-intdot" if self.int_dot
                     else "int8-cpu" if self.fast else "int8-triton" if self.triton
                     else "int8-dequant")

    def _to_panels(self, tensors):
        return csrc.int8_to_vnni(tensors["qweight"], tensors["scale"], self.group)

    def _from_panels(self):
        qweight, scale = csrc.int8_from_vnni(*self.panels, self.out_features)
        return {"qweight": qweight, "scale": scale,
                **({} if self.offset is None else {"offset": self.offset})}

    def weight_bytes(self) -> int:
        extra = 0 if self.offset is None or not self.vnni else self.offset.numel() * 4
        return super().weight_bytes() + extra

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group: int | None = None,
                    row_absmax: torch.Tensor | None = None) -> Int8Kernel:
        q, scale = schemes.quantize_int8(weight, group, row_absmax)
        return cls({"qweight": q, "scale": scale})

    def dequantize(self) -> torch.Tensor:
        tensors = self.tensors
        weight = schemes.dequantize_int8(tensors["qweight"], tensors["scale"])
        if self.offset is None:
            return weight
        n, k = weight.shape
        return (weight.view(n, -1, self.group) + self.offset[..., None]).view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vnni:
            q, scale = csrc.int8_vnni_rows(*self.panels, ids)
        else:
            q, scale = self.qweight[ids], self.scale[ids]
        weight = schemes.dequantize_int8(q, scale)
        if self.offset is None:
            return weight
        return (weight.view(len(ids), -1, self.group) + self.offset[ids][..., None]).view(
            weight.shape)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        out = self._integer(layer, x)
        if self.offset is None:
            return out
        sums = x.reshape(*x.shape[:-1], -1, self.group).sum(-1)
        return out + (sums.float() @ self.offset.T).to(out.dtype)

    def _integer(self, layer, x: torch.Tensor) -> torch.Tensor:
        """x @ (q x scale)^T (+ bias): the weight without its offsets."""
        if self.fast and x.dim() == 2 and x.dtype == torch.float32:
            if self.vnni:
                return csrc.int8_vnni_gemm(x.contiguous(), *self.panels, self.out_features,
                                           layer.bias, self.group)
            if x.shape[0] > INT8_MAX_ROWS:
                return csrc.int8_panel_gemm(x.contiguous(), self.qweight, self.scale,
                                            layer.bias, self.group)
            gemm = csrc.int8_gemm_int_dot if self.int_dot else csrc.int8_gemm
            return gemm(x.contiguous(), self.qweight, self.scale, layer.bias, self.group)
        if self.triton:
            return _triton_kernels().weight_only_matmul(x, self.qweight, self.scale, None,
                                                        layer.bias, self.group)
        weight = schemes.dequantize_int8(self.qweight, self.scale)
        return F.linear(x, weight.to(x.dtype), layer.bias)

    def compiled_form(self) -> csrc.LinearForm | None:
        if self.offset is not None:
            return None
        if self.vnni:
            return self._vnni_form(csrc.INT8_VNNI)
        if not self.fast:
            return None
        return csrc.LinearForm(csrc.INT8_Q16 if self.int_dot else csrc.INT8, self.group,
                               INT8_MAX_ROWS, self.qweight.data_ptr(), self.scale.data_ptr())


class Int4Kernel(_PanelKernel):
    """Weight-only 4-bit, asymmetric per group of inputs (GGUF Q4_1's scheme and layout).
    With VNNI the weight lives in panels (see `_PanelKernel`)."""

    method = "int4"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        qweight = tensors["qweight"]
        scale, mins = tensors["scale"].half(), tensors["min"].half()
        self.out_features, k = qweight.shape[0], qweight.shape[1] * 2
        self.group = k // scale.shape[1]
        # (the compiled int4 kernels step through a group 32 inputs at a time)
        self.fast = self._on_fast_cpu() and self.group % 32 == 0
        self.int_dot = self.fast and self._int_dot(k, self.group, groups_of_32_only=True)
        self.triton = self._on_triton_gpu(k) and self.group % 32 == 0
        # the panels take any group that is a multiple of 32 (gemm.c's int16 kernel: only 32)
        self._keep({"qweight": qweight, "scale": scale, "min": mins},
                   self.fast and self._int_dot(k, self.group) and csrc.vnni_native())
        self.name = ("int4-cpu-vnni" if self.vnni else "int4-cpu-intdot" if self.int_dot
                     else "int4-cpu" if self.fast else "int4-triton" if self.triton
                     else "int4-dequant")

    def _to_panels(self, tensors):
        return csrc.int4_to_vnni(tensors["qweight"], tensors["scale"], tensors["min"],
                                 self.group)

    def _from_panels(self):
        qweight, scale, mins = csrc.int4_from_vnni(*self.panels, self.out_features)
        return {"qweight": qweight, "scale": scale, "min": mins}

    @property
    def mins(self) -> torch.Tensor:
        return self.tensors["min"]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vnni:
            return schemes.dequantize_int4_values(*csrc.int4_vnni_rows(*self.panels, ids))
        return schemes.dequantize_int4(self.qweight[ids], self.scale[ids], self.mins[ids])

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group: int = 32) -> Int4Kernel:
        packed, scale, mins = schemes.quantize_int4(weight, group)
        return cls({"qweight": packed, "scale": scale, "min": mins})

    def dequantize(self) -> torch.Tensor:
        tensors = self.tensors
        return schemes.dequantize_int4(tensors["qweight"], tensors["scale"], tensors["min"])

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.fast and x.dim() == 2 and x.dtype == torch.float32:
            if self.vnni:
                return csrc.int4_vnni_gemm(x.contiguous(), *self.panels, self.out_features,
                                           layer.bias, self.group)
            if x.shape[0] > INT4_MAX_ROWS:
                return csrc.int4_panel_gemm(x.contiguous(), self.qweight, self.scale, self.mins,
                                            layer.bias, self.group)
            if self.int_dot:
                return csrc.int4_gemm_int_dot(x.contiguous(), self.qweight, self.scale, self.mins,
                                         layer.bias)
            return csrc.int4_gemm(x.contiguous(), self.qweight, self.scale, self.mins,
                                  layer.bias, self.group)
        if self.triton:
            return _triton_kernels().weight_only_matmul(x, self.qweight, self.scale, self.mins,
                                                        layer.bias, self.group)
        return self.reference(layer, x)

    def compiled_form(self) -> csrc.LinearForm | None:
        if self.vnni:
            return self._vnni_form(csrc.INT4_VNNI)
        if not self.fast:
            return None
        return csrc.LinearForm(csrc.INT4_Q16 if self.int_dot else csrc.INT4, self.group,
                               INT4_MAX_ROWS, self.qweight.data_ptr(), self.scale.data_ptr(),
                               self.mins.data_ptr())


class _PartBias:
    """What a part's kernel reads of its layer: the part's slice of the bias."""

    def __init__(self, bias: torch.Tensor | None) -> None:
        self.bias = bias


class PartsKernel(QuantizedKernel):
    """A merged layer (q|k|v, gate|up) whose parts are stored in different formats (a GGUF
    Q4_K_M keeps v in Q6_K beside Q4_K q and k): each part multiplies with its own kernel,
    the outputs side by side (the compiled decode step runs them the same way)."""

    method = "parts"
    name = "parts"

    def __init__(self, parts: list[QuantizedKernel], sizes: list[int]) -> None:
        super().__init__({})
        self.parts, self.sizes = parts, sizes
        self.name = "parts:" + "+".join(part.name for part in parts)

    def _biases(self, layer) -> list[_PartBias]:
        if layer.bias is None:
            return [_PartBias(None)] * len(self.parts)
        return [_PartBias(b) for b in layer.bias.split(self.sizes)]

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.apply(bias, x) for part, bias
                          in zip(self.parts, self._biases(layer))], dim=-1)

    def reference(self, layer, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.reference(bias, x) for part, bias
                          in zip(self.parts, self._biases(layer))], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])

    def weight_bytes(self) -> int:
        return sum(part.weight_bytes() for part in self.parts)

