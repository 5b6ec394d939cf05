"""The GPU weight-only kernels, run by Triton's interpreter on the CPU (conftest sets
TRITON_INTERPRET=1 where no GPU exists): against dequantize-then-matmul."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.quantization.linear_kernels import Int4Kernel, Int8Kernel

triton_kernels = pytest.importorskip("tokenmill.quantization.triton_kernels")
device = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kernel,kwargs", [(Int8Kernel, {}), (Int8Kernel, {"group": 32}),
                                           (Int4Kernel, {"group": 32}),
                                           (Int4Kernel, {"group": 64})])
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("bias", [True, False])
def test_triton_weight_only_matmul_matches_dequantize_then_matmul(kernel, kwargs, rows, bias):
    torch.manual_seed(0)
    w = torch.randn(70, 128) * 0.05  # 70: not a multiple of the 64-channel tile
    k = kernel.from_weight(w, **kwargs)
    x = torch.randn(rows, 128)
    b = torch.randn(70) if bias else None
    mins = k.mins.to(device) if kernel is Int4Kernel else None
    y = triton_kernels.weight_only_matmul(x.to(device), k.qweight.to(device),
                                          k.scale.to(device), mins,
                                          None if b is None else b.to(device), k.group)
    torch.testing.assert_close(y.cpu(), F.linear(x, k.dequantize(), b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [Int8Kernel, Int4Kernel])
def test_kernels_route_gpu_weights_to_triton(kernel, monkeypatch):
    # What a CUDA device selects, exercised here on CPU tensors through the interpreter.
    from tokenmill.layers.linear import Linear
    from tokenmill.quantization import linear_kernels

    monkeypatch.setattr(linear_kernels.QuantizedKernel, "_on_fast_cpu", lambda self: False)
    monkeypatch.setattr(linear_kernels.QuantizedKernel, "_on_triton_gpu", lambda self, k: True)
    layer = Linear(64, 40, bias=True).to(device)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_()
    k = kernel.from_weight(layer.weight.detach())
    assert k.triton and k.name.endswith("triton")
    calls = []
    monkeypatch.setattr(triton_kernels, "weight_only_matmul",
                        lambda *a, f=triton_kernels.weight_only_matmul: calls.append(1) or f(*a))
    x = torch.randn(3, 64, device=device)
    torch.testing.assert_close(k.apply(layer, x), k.reference(layer, x), rtol=1e-4, atol=1e-4)
    assert calls


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9),
                    reason="torch._scaled_mm needs float8 units (Ada / Hopper)")
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_fp8_weights_through_scaled_mm_on_the_gpu(per_channel, rows):
    # --quantization fp8 on a GPU with float8 units: torch._scaled_mm at decode (1 row) and
    # prompt row counts, against the same rounding done by dequantizing
    from tokenmill.quantization.activation_kernels import Fp8Kernel

    torch.manual_seed(rows)
    lin = torch.nn.Linear(128, 96).to(device, torch.bfloat16)
    k = Fp8Kernel.from_weight(lin.weight.detach(), per_channel)
    assert k.name == "fp8-scaled-mm"
    x = torch.randn(rows, 128, device=device, dtype=torch.bfloat16)
    torch.testing.assert_close(k.apply(lin, x).float(), k.reference(lin, x).float(),
                               rtol=2e-2, atol=2e-2)
