"""The GPU's one-kernel layer ops (layers/triton_ops.py) against the torch ops they replace
(norm.py, rotary.py, activation.py), rounding for rounding; on a machine without a GPU in
Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import triton_ops
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, StepRotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter converts to bfloat16 wrongly"))]


def exact(dtype):
    """float32: the same products, summed in another order; 16-bit: at most one rounding step
    apart (the sum of squares in another order can tip a rounding)."""
    return {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=1e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 896])
def test_add_rms_norm(dtype, hidden):
    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    norm.weight.data = torch.randn(hidden, device=DEVICE).to(dtype)
    x = torch.randn(5, hidden + 8, device=DEVICE).to(dtype)[:, :hidden]  # strided rows
    residual = torch.randn(5, hidden, device=DEVICE).to(dtype)
    torch.testing.assert_close(triton_ops.add_rms_norm(x, None, norm.weight, 1e-6),
                               norm._norm(x), **exact(dtype))
    total = x + residual
    out, res = triton_ops.add_rms_norm(x, residual.clone(), norm.weight, 1e-6)
    assert torch.equal(res, total)  # the new residual: the sum, rounded as torch rounds it
    torch.testing.assert_close(out, norm._norm(total), **exact(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 80])
def test_rotary_q_and_k_heads_together(dtype, head_dim):
    rotary = RotaryEmbedding(head_dim, 256, {"rope_type": "default", "rope_theta": 10000.0},
                             256).to(DEVICE)
    positions = torch.tensor([0, 3, 255, 17, 100], device=DEVICE)
    qkv = torch.randn(5, 7 * head_dim + 3, device=DEVICE).to(dtype)  # a wider qkv row
    x = qkv[:, : 6 * head_dim].view(5, 6, head_dim)
    step = StepRotary(rotary, positions, dtype)
    step.compiled = False
    ref = step(x)  # the torch ops (x is not on a GPU here, or the kernel would run)
    out = triton_ops.rotary(x, rotary.cos, rotary.signed_sin, positions)
    torch.testing.assert_close(out, ref, **exact(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activations(dtype, gelu):
    x = torch.randn(4, 2 * 1300, device=DEVICE).to(dtype) * 3  # two column blocks of 1024
    gate, up = x.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    torch.testing.assert_close(triton_ops.gated(x, gelu), act * up, **exact(dtype))


def test_used_only_for_gpu_tensors():
    assert not triton_ops.usable(torch.zeros(2))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("setting", [(8, 128, 1, 4), (16, 128, 3, 4), (32, 256, 2, 4)])
def test_skinny_matmul_of_the_sweep_matches_linear(rows, setting):
    # bench/gemv_sweep.py's kernel (column blocks, K ranges summed by atomics), measured
    # against cuBLAS on GPUs before the engine would use it; 300 inputs: a partial K block
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import gemv_sweep

    torch.manual_seed(rows)
    x, w = torch.randn(rows, 300, device=DEVICE), torch.randn(70, 300, device=DEVICE)
    assert gemv_sweep.check(x, w, setting)
