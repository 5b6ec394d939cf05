"""bf16 weights on the CPU (layers/bf16_linear.py, csrc/bf16_panel.c): the kernel against the
slow formula at every row count and shape the tiles and threads split differently, and the
kernel choice and loading that give a float32 model bf16 linears."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import csrc
from tokenmill.layers.bf16_linear import (
    CpuBf16Kernel,
    look_up_in_panels,
    store_in_bf16,
    tied_tables,
)
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.kernel_choice import choose_linear_kernels
from tokenmill.layers.linear import CpuPackedKernel, Linear, MergedLinear

pytestmark = pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")


def _layer(k: int, n: int, bias: bool, seed: int) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    return layer


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to fp32 rounding of the sums (products of bf16 values are exact in fp32)."""
    scale = float(ref.abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(ours, ref, atol=2e-6 * scale + 1e-6, rtol=0)


# Shapes: K odd (a zero pads the last pair), N not a multiple of 64 (a partial panel), a
# single panel, several; rows: the single-row pass, tiles of 1-6 rows, a panel's rows split
# between threads (>= 12), the 32-row passes, a 128-row k-chunk.
@pytest.mark.parametrize("k,n", [(64, 64), (77, 130), (576, 192), (300, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_the_bf16_formula_at_every_row_count(k, n, bias):
    layer = _layer(k, n, bias, seed=k + n)
    weight, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias
    kernel = CpuBf16Kernel(layer)
    for rows in (0, 1, 2, 5, 7, 12, 13, 32, 33, 100):
        x = torch.randn(rows, k) * 3
        _close(kernel.apply(layer, x), CpuBf16Kernel.reference(x, weight, b))
    # leading dims kept; a non-contiguous view of activations
    x = torch.randn(2, 3, k)
    _close(kernel.apply(layer, x), CpuBf16Kernel.reference(x, weight, b))
    wide = torch.randn(4, k + 16)[:, 8:8 + k]
    _close(kernel.apply(layer, wide), CpuBf16Kernel.reference(wide, weight, b))


def test_x_rounds_to_nearest_even_and_keeps_special_values():
    """x is rounded to bf16 the way torch rounds (ties to even), infinities and NaN kept; a
    subnormal may become zero (`vdpbf16ps` treats subnormal inputs as zero)."""
    layer = _layer(64, 64, False, seed=3)
    layer.weight.data.fill_(0).diagonal().fill_(1.0)  # y = x, rounded to bf16
    kernel = CpuBf16Kernel(layer)
    tie = 1.0 + 2.0**-8  # halfway between two bf16 values: rounds to even (1.0)
    x = torch.tensor([1.0 + 3 * 2.0**-9, tie, -tie, 3.0e38, 65504.0, 1.0 / 3.0] + [0.5] * 58)
    y = kernel.apply(layer, x[None])[0]
    torch.testing.assert_close(y, x.to(torch.bfloat16).float(), rtol=0, atol=0)
    tiny = torch.zeros(64)
    tiny[0] = 1e-40
    assert float(kernel.apply(layer, tiny[None])[0, 0]) in (0.0, float(tiny.to(torch.bfloat16)[0]))
    special = torch.zeros(2, 64)
    special[0, 0], special[1, 1] = float("inf"), float("nan")
    y = kernel.apply(layer, special)
    assert y[0, 0] == float("inf") and torch.isnan(y[1, 1])


def test_gated_pass_equals_product_then_silu():
    layer = MergedLinear(96, [128, 128], bias=True)
    torch.manual_seed(5)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    kernel = CpuBf16Kernel(layer)
    for rows in (1, 6, 40):
        x = torch.randn(rows, 96)
        full = CpuBf16Kernel.reference(x, weight, bias)
        want = F.silu(full[:, :128]) * full[:, 128:]
        got = kernel.apply_gated(layer, x)
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-5)


def test_loading_into_bf16_and_the_kernel_choice():
    """Owned linear weights load into bf16; a tied LM head keeps the embedding's float32
    table for lookups and gets bf16 panels of its own; a layer kept in float (a router) or
    read directly (MLA's kv_b_proj) keeps float32."""
    model = nn.Module()
    model.embed = nn.Embedding(100, 64)
    model.head = Linear(64, 100)
    model.head.weight = model.embed.weight  # tied
    model.proj = Linear(64, 96, bias=True)
    model.router = Linear(64, 8)
    model.router.keep_float = True
    model.kv_b = Linear(64, 32)
    model.kv_b.keep_weight = True
    loader = model.proj.weight.weight_loader
    store_in_bf16(model)
    assert model.proj.weight.dtype == torch.bfloat16
    assert model.proj.weight.weight_loader is loader  # the loaders still find their params
    assert model.proj.bias.dtype == torch.float32
    for kept in (model.embed, model.router, model.kv_b):
        assert kept.weight.dtype == torch.float32
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_()
    proj_w, head_w = model.proj.weight.detach().clone(), model.embed.weight.detach().clone()
    counts = choose_linear_kernels(model, bf16_weights=True)
    assert counts == {"cpu-bf16": 2, "cpu-packed": 1, "dense": 1}
    assert isinstance(model.router.kernel, CpuPackedKernel)
    assert model.embed.weight.dtype == torch.float32 and model.embed.weight.shape == (100, 64)
    x = torch.randn(3, 64)
    _close(model.head(x), CpuBf16Kernel.reference(x, head_w, None))
    _close(model.proj(x), CpuBf16Kernel.reference(x, proj_w, model.proj.bias))


@pytest.mark.parametrize("isa", ["-mno-avx512bf16", "-mno-avx512f"])
def test_widened_paths_of_cpus_without_bf16_dot_products(tmp_path, isa):
    """The builds of CPUs without AVX512-BF16 (AVX-512F, or AVX2 only) widen the pairs to fp32:
    built here with those instructions switched off, the same products as the formula."""
    import ctypes

    from helpers import build_kernels_without

    lib = build_kernels_without(tmp_path, [isa], "panel_gemm.c", "bf16_panel.c")
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.tm_bf16_panel_gemm.argtypes = [ptr] * 4 + [i64] * 4
    lib.tm_bf16_panel_gemm.restype = i64
    lib.tm_bf16_native.restype = i64
    assert lib.tm_bf16_native() == 0
    layer = _layer(77, 130, True, seed=9)
    panels = CpuBf16Kernel(layer).panels
    for rows in (1, 5, 13, 40):
        x = torch.randn(rows, 77)
        y = torch.empty(rows, 130)
        assert lib.tm_bf16_panel_gemm(x.data_ptr(), panels.data_ptr(), layer.bias.data_ptr(),
                                      y.data_ptr(), rows, 130, 77, panels.shape[1] * 2) == 0
        _close(y, CpuBf16Kernel.reference(x, layer.weight, layer.bias))


def test_tables_load_into_bf16_and_a_tied_one_reads_its_heads_panels():
    """Embedding tables load into bf16 and look up float32 rows; a table tied to its LM head
    stays one tensor through loading, and after the kernel choice reads the head's panels
    (the same values) instead of keeping a copy."""
    model = nn.Module()
    model.embed = VocabParallelEmbedding(130, 77)
    model.head = ParallelLMHead(77, 130)
    model.head.weight = model.embed.weight
    model.other = VocabParallelEmbedding(50, 77)  # an untied table
    store_in_bf16(model)
    assert model.head.weight is model.embed.weight and model.embed.weight.dtype == torch.bfloat16
    assert model.other.weight.dtype == torch.bfloat16
    torch.manual_seed(2)
    for table in (model.embed, model.other):
        table.weight.data.normal_()
    values = model.embed.weight.detach().float().clone()
    ids = torch.tensor([[0, 49, 1], [7, 5, 48]])  # (the untied table has 50 rows)
    pairs = tied_tables(model)
    assert pairs == [(model.embed, model.head)]
    assert choose_linear_kernels(model, bf16_weights=True) == {"cpu-bf16": 1}
    look_up_in_panels(pairs)
    assert model.embed.weight is None  # one copy: the head's panels
    far = torch.tensor([[0, 63, 64], [129, 5, 64]])  # both sides of a panel, the last row
    for table, want, at in ((model.embed, values, far),
                            (model.other, model.other.weight.float(), ids)):
        rows = table(at)
        assert rows.dtype == torch.float32 and rows.shape == (2, 3, 77)
        torch.testing.assert_close(rows, want[at], rtol=0, atol=0)
    x = torch.randn(4, 77)
    _close(model.head(x), CpuBf16Kernel.reference(x, values, None))
