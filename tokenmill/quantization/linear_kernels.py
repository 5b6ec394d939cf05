"""Quantized kernels for `Linear`: each holds its quantized tensors (the layer's float weight is
dropped) and multiplies by them. The fast path is picked once, at construction, from the device
(CPU: compiled AVX2 kernels / fbgemm; CUDA: Triton, `torch._scaled_mm`);
`reference()` is the plain dequantize-then-matmul path beside it, used where no fast kernel
exists and by the tests that check the fast path against it."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from tokenmill import csrc
from tokenmill.config import CpuKernelSettings
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

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

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
        return shape_ok and CpuKernelSettings.from_env().int_dot

    def _on_triton_gpu(self, k: int) -> bool:
        first = next(iter(self.tensors.values()))
        return first.device.type == "cuda" and k % 32 == 0 and _triton_kernels() is not None


def _triton_kernels():
    try:
        from tokenmill.quantization import triton_kernels
    except ImportError:  # no triton installed
        return None
    return triton_kernels


class _PanelKernel(QuantizedKernel):
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

    @property
    def qweight(self) -> torch.Tensor:
        return self.tensors["qweight"]

    @property
    def scale(self) -> torch.Tensor:
        return self.tensors["scale"]

    def weight_bytes(self) -> int:
        if self.vnni:
            return sum(t.numel() * t.element_size() for t in self.panels)
        return super().weight_bytes()

    def _vnni_form(self, kind: int) -> csrc.LinearForm:
        return csrc.LinearForm(kind, self.group, VNNI_MAX_ROWS,
                               *(t.data_ptr() for t in self.panels))


class Int8Kernel(_PanelKernel):
    """Weight-only int8, symmetric per output channel (or per group, as GGUF Q8_0 stores).
    With VNNI the weight lives in panels (see `_PanelKernel`)."""

    method = "int8"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        qweight, scale = tensors["qweight"], tensors["scale"].float()
        self.out_features, k = qweight.shape
        self.group = k // scale.shape[1]
        self.fast = self._on_fast_cpu() and self.group % 8 == 0
        self.int_dot = self.fast and self._int_dot(k, self.group)
        self.triton = self._on_triton_gpu(k)
        self._keep({"qweight": qweight, "scale": scale}, self.int_dot and csrc.vnni_native())
        self.name = ("int8-cpu-vnni" if self.vnni else "int8-cpu-intdot" if self.int_dot
                     else "int8-cpu" if self.fast else "int8-triton" if self.triton
                     else "int8-dequant")

    def _to_panels(self, tensors):
        return csrc.int8_to_vnni(tensors["qweight"], tensors["scale"], self.group)

    def _from_panels(self):
        qweight, scale = csrc.int8_from_vnni(*self.panels, self.out_features)
        return {"qweight": qweight, "scale": scale}

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group: int | None = None,
                    row_absmax: torch.Tensor | None = None) -> Int8Kernel:
        q, scale = schemes.quantize_int8(weight, group, row_absmax)
        return cls({"qweight": q, "scale": scale})

    def dequantize(self) -> torch.Tensor:
        tensors = self.tensors
        return schemes.dequantize_int8(tensors["qweight"], tensors["scale"])

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
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
        return self.reference(layer, x)

    def compiled_form(self) -> csrc.LinearForm | None:
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
        self.fast = self._on_fast_cpu()
        self.int_dot = self.fast and self._int_dot(k, self.group, groups_of_32_only=True)
        self.triton = self._on_triton_gpu(k)
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


class A8W8Kernel(QuantizedKernel):
    """int8 weights (per output channel) times int8 activations, quantized to asymmetric 7-bit:
    per token from each call's range (dynamic) or per tensor from a calibrated range (static),
    after dividing by the SmoothQuant factors when calibration produced them.
    CPU fast path: fbgemm/oneDNN int8 GEMMs."""

    method = "a8w8"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.qweight, self.scale = tensors["qweight"], tensors["scale"].float().reshape(-1)
        smooth = tensors.get("smooth")
        self.inv_smooth = None if smooth is None else (1.0 / smooth.float())
        act = tensors.get("act_range")  # [low, high] of the smoothed activations
        self.static = None if act is None else schemes.uint8_activation_params(act[0], act[1])
        self.packed = None
        if self.qweight.device.type == "cpu":
            if self.static is None:
                with warnings.catch_warnings():  # torch's quantized tensors are deprecated;
                    warnings.simplefilter("ignore")  # fbgemm's packed GEMM is the fast one
                    qw = torch._make_per_channel_quantized_tensor(
                        self.qweight, self.scale.double(),
                        torch.zeros_like(self.scale, dtype=torch.long), 0)
                self.packed = torch.ops.quantized.linear_prepack(qw, None)
            else:
                self.packed = torch.ops.onednn.qlinear_prepack(self.qweight, None)
        self.name = "a8w8-cpu" if self.packed is not None else "a8w8-dequant"

    @classmethod
    def from_weight(cls, weight: torch.Tensor, smooth: torch.Tensor | None = None,
                    act_range: torch.Tensor | None = None,
                    row_absmax: torch.Tensor | None = None) -> A8W8Kernel:
        if smooth is not None:
            weight = weight.float() * smooth[None, :]
        q, scale = schemes.quantize_int8(weight, row_absmax=row_absmax)
        tensors = {"qweight": q, "scale": scale.reshape(-1)}
        if smooth is not None:
            tensors["smooth"] = smooth.float()
        if act_range is not None:
            tensors["act_range"] = act_range.float()
        return cls(tensors)

    def dequantize(self) -> torch.Tensor:
        return schemes.dequantize_int8(self.qweight, self.scale[:, None])

    def _smoothed(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.inv_smooth is None else x * self.inv_smooth.to(x.dtype)

    def reference(self, layer, x: torch.Tensor) -> torch.Tensor:
        x = self._smoothed(x.float())
        if self.static is None:
            rows = schemes.row_scales(x)
            x = x / rows
            x = schemes.fake_quantize_uint8(x, *schemes.uint8_activation_params(x.min(),
                                                                                x.max()))
            x = x * rows
        else:
            x = schemes.fake_quantize_uint8(x, *self.static, upper=schemes.ACT_LEVELS)
        return F.linear(x, self.dequantize(), layer.bias.float() if layer.bias is not None
                        else None)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != torch.float32:
            return self.reference(layer, x).to(x.dtype)
        x = self._smoothed(x)
        if self.static is None:
            # Rows scaled to one range first, so the per-tensor quantization fbgemm applies
            # is in effect per token (a token with huge activations, such as the first one,
            # no longer flattens the others); reduce_range: 7 bits, see schemes.ACT_LEVELS.
            rows = schemes.row_scales(x)
            y = torch.ops.quantized.linear_dynamic((x / rows).contiguous(), self.packed, True)
            y = y * rows
        else:
            scale, zero = self.static
            qx = schemes.quantize_uint8(x, scale, zero, schemes.ACT_LEVELS).to(torch.uint8)
            y = torch.ops.onednn.qlinear_pointwise(
                qx, scale, zero, self.packed, self.scale,
                torch.zeros_like(self.scale, dtype=torch.long), None, 1.0, 0, torch.float32,
                "none", [], "")
        return y if layer.bias is None else y + layer.bias


class Fp8Kernel(QuantizedKernel):
    """W8A8 float8 e4m3: weights with per-channel or per-tensor scales, activations rounded
    through e4m3 with a per-tensor scale (dynamic, or static from calibration). On GPUs with
    fp8 units the matmul is `torch._scaled_mm`; elsewhere a dequantizing path."""

    method = "fp8"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.qweight, self.scale = tensors["qweight"], tensors["scale"].float()
        self.act_scale = tensors.get("act_scale")
        device = self.qweight.device
        self.scaled_mm = (device.type == "cuda"
                          and torch.cuda.get_device_capability(device) >= (8, 9))
        self.name = "fp8-scaled-mm" if self.scaled_mm else "fp8-dequant"

    @classmethod
    def from_weight(cls, weight: torch.Tensor, per_channel: bool = True,
                    act_absmax: torch.Tensor | None = None,
                    row_absmax: torch.Tensor | None = None) -> Fp8Kernel:
        q, scale = schemes.quantize_fp8(weight, per_channel, row_absmax)
        tensors = {"qweight": q, "scale": scale}
        if act_absmax is not None:
            tensors["act_scale"] = (act_absmax.float().clamp(min=1e-12)
                                    / schemes.FP8_MAX).reshape(1)
        return cls(tensors)

    def dequantize(self) -> torch.Tensor:
        scale = self.scale if self.scale.numel() > 1 else self.scale.expand(
            self.qweight.shape[0])
        return schemes.dequantize_fp8(self.qweight, scale)

    def reference(self, layer, x: torch.Tensor) -> torch.Tensor:
        x = schemes.fake_quantize_fp8(x.float(), self.act_scale)
        return F.linear(x, self.dequantize(), layer.bias).to(x.dtype)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if not self.scaled_mm:
            return self.reference(layer, x).to(x.dtype)
        act_scale = self.act_scale
        if act_scale is None:
            act_scale = x.abs().amax().float().clamp(min=1e-12) / schemes.FP8_MAX
        qx = (x / act_scale).clamp(-schemes.FP8_MAX, schemes.FP8_MAX).to(torch.float8_e4m3fn)
        w_scale = self.scale.reshape(1, -1) if self.scale.numel() > 1 else self.scale
        x_scale = act_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous() \
            if self.scale.numel() > 1 else act_scale.reshape(())
        y = torch._scaled_mm(qx, self.qweight.t(), scale_a=x_scale, scale_b=w_scale,
                             bias=layer.bias, out_dtype=x.dtype)
        return y


KERNELS = {cls.method: cls for cls in (Int8Kernel, Int4Kernel, A8W8Kernel, Fp8Kernel)}
