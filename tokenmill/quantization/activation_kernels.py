"""Activation-quantized kernels for `Linear`: int8 weights times int8 activations (a8w8,
SmoothQuant) and fp8 weights times fp8 activations, each beside its dequantize-then-matmul
reference (linear_kernels.QuantizedKernel)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from tokenmill.quantization import schemes
from tokenmill.quantization.linear_kernels import QuantizedKernel


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
