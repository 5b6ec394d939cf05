"""Quantization arithmetic and kernels: the schemes against GGUF's own dequantizer and
against their error bounds, every fast kernel against its dequantize-then-matmul path."""

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill import csrc
from tokenmill.config.kernels import CpuKernelSettings
from tokenmill.layers.linear import Linear
from tokenmill.quantization import linear_kernels, schemes
from tokenmill.quantization.activation_kernels import A8W8Kernel, Fp8Kernel
from tokenmill.quantization.linear_kernels import Int4Kernel, Int8Kernel
from tokenmill.quantization.model import KERNELS

needs_csrc = pytest.mark.skipif(not csrc.available(),
                                       reason="no C compiler or no AVX2/FMA/F16C")


def layer(n=98, k=128, bias=True, seed=0):  # n: not a multiple of the 4-channel tiles
    torch.manual_seed(seed)
    lin = Linear(k, n, bias)
    lin.weight.data.normal_(0, 0.05)
    if bias:
        lin.bias.data.normal_(0, 0.1)
    return lin


def test_compiled_kernels_build_where_a_compiler_and_avx2_exist():
    # Guards against the CPU tests below skipping silently on a machine that could run them.
    settings = CpuKernelSettings.from_env()
    if not settings.enabled or not csrc.build.cpu_has_avx2():
        pytest.skip("kernels disabled or CPU without AVX2/FMA/F16C")
    if shutil.which(settings.compiler) or shutil.which("gcc"):
        assert csrc.available()


@pytest.mark.parametrize("group", [None, 32])
def test_int8_round_trip_within_half_a_step(group):
    w = torch.randn(40, 64)
    q, scale = schemes.quantize_int8(w, group)
    assert q.dtype == torch.int8 and scale.shape == (40, 64 // (group or 64))
    err = (schemes.dequantize_int8(q, scale) - w).abs()
    step = scale.repeat_interleave(group or 64, dim=1)
    assert (err <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step_and_packing_is_invertible(group):
    w = torch.randn(24, 256) + 0.3
    packed, scale, mins = schemes.quantize_int4(w, group)
    assert packed.shape == (24, 128) and packed.dtype == torch.uint8
    assert scale.dtype == mins.dtype == torch.float16
    step = scale.float().repeat_interleave(group, dim=1)
    assert ((schemes.dequantize_int4(packed, scale, mins) - w).abs() <= step / 2 + 2e-3).all()
    q = torch.randint(0, 16, (5, 64))
    assert torch.equal(schemes.unpack_int4(schemes.pack_int4(q)), q.to(torch.uint8))


def test_int4_refuses_groups_that_do_not_fit():
    with pytest.raises(ValueError, match="multiple of 32"):
        schemes.quantize_int4(torch.randn(4, 64), 48)
    with pytest.raises(ValueError, match="does not divide"):
        schemes.quantize_int4(torch.randn(4, 96), 64)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_read_as_gguf_dequantizes_them(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from tokenmill.loading.gguf import _quantized_shard

    w = np.random.default_rng(0).normal(size=(8, 96)).astype(np.float32)
    kind = GGMLQuantizationType[qtype]
    blocks = quantize(w, kind)
    shard = _quantized_shard(blocks, qtype, [8, 96])
    ours = KERNELS[shard.method](shard.tensors).dequantize()
    expected = torch.from_numpy(dequantize(blocks, kind).reshape(8, 96))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


@needs_csrc
@pytest.mark.parametrize("kernel,kwargs", [(Int8Kernel, {}), (Int8Kernel, {"group": 32}),
                                           (Int4Kernel, {"group": 32}),
                                           (Int4Kernel, {"group": 64})])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_compiled_weight_only_kernels_match_dequantize_then_matmul(kernel, kwargs, rows, bias,
                                                                   monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_INT_DOT", "0")  # float activations: exact weight-only
    lin = layer(bias=bias)
    k = kernel.from_weight(lin.weight.detach(), **kwargs)
    assert k.fast and not k.int_dot
    x = torch.randn(rows + 4, 128)[2:2 + rows]  # an offset view: made contiguous by the kernel
    expected = F.linear(x, k.dequantize(), lin.bias)
    torch.testing.assert_close(k.apply(lin, x), expected, rtol=1e-4, atol=1e-4)


@needs_csrc
@pytest.mark.parametrize("kernel,kwargs", [(Int8Kernel, {}), (Int8Kernel, {"group": 32}),
                                           (Int4Kernel, {"group": 32})])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_int_dot_kernels_match_int16_activations_times_dequantized_weights(kernel, kwargs, rows,
                                                                         bias):
    # K = 320: ten blocks of 32, so the int4 kernel's 8-block batches and its remainder both run
    lin = layer(k=320, bias=bias)
    k = kernel.from_weight(lin.weight.detach(), **kwargs)
    assert k.int_dot and k.name.endswith("vnni" if k.vnni else "intdot")
    x = torch.randn(rows + 4, 320)[2:2 + rows] * 3
    x[0, :32] = 0  # an all-zero block (scale 0)
    x[-1, 40] = 200.0  # an outlier dominating its block
    expected = F.linear(schemes.fake_quantize_blocks(x), k.dequantize(), lin.bias)

    def int_dot(rows_of_x):  # the kernel itself: apply() takes it up to the layer's row limit
        if kernel is Int8Kernel:
            return csrc.int8_gemm_int_dot(rows_of_x.contiguous(), k.qweight, k.scale, lin.bias,
                                          k.group)
        return csrc.int4_gemm_int_dot(rows_of_x.contiguous(), k.qweight, k.scale, k.mins,
                                      lin.bias)

    out = int_dot(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    limit = (linear_kernels.INT8_MAX_ROWS if kernel is Int8Kernel
             else linear_kernels.INT4_MAX_ROWS)
    if rows <= limit and not k.vnni:
        assert torch.equal(k.apply(lin, x), out)
    for i in {0, rows // 2, rows - 1}:  # a row's sums do not depend on the rows beside it
        assert torch.equal(int_dot(x[i:i + 1]), out[i:i + 1])
    # 16-bit activations cost almost nothing against float ones, even with the outlier
    # (int8 per 32 inputs, llama.cpp's rounding, is ~100x coarser: shown for contrast)
    exact = F.linear(x, k.dequantize(), lin.bias)
    int8_like = F.linear(schemes.fake_quantize_blocks(x, bits=8), k.dequantize(), lin.bias)
    error = (out - exact).abs().max()
    assert error < 1e-3 * exact.abs().max()
    assert error * 30 < (int8_like - exact).abs().max()


@needs_csrc
@pytest.mark.parametrize("kernel,kwargs", [(Int8Kernel, {}), (Int8Kernel, {"group": 32}),
                                           (Int4Kernel, {"group": 32}),
                                           (Int4Kernel, {"group": 64})])
def test_prompt_rows_unpack_the_weights_into_fp32_panels_exactly(kernel, kwargs):
    # Prompt-sized calls dequantize into the fp32 panel layout and run the fp32 panel kernel.
    # Rows of the identity pick each weight out (1 * w + 0 is exact): every unpacked value
    # equals dequantize()'s, the last panel's 34 channels (n = 98) included.
    lin = layer(bias=False)
    k = kernel.from_weight(lin.weight.detach(), **kwargs)
    eye = torch.eye(128)
    if kernel is Int8Kernel:
        out = csrc.int8_panel_gemm(eye, k.qweight, k.scale, None, k.group)
    else:
        out = csrc.int4_panel_gemm(eye, k.qweight, k.scale, k.mins, None, k.group)
    assert torch.equal(out, k.dequantize().T)
    rows = max(linear_kernels.INT8_MAX_ROWS, linear_kernels.INT4_MAX_ROWS) + 5
    x = torch.randn(rows, 128)
    tol = 1e-3 if k.vnni else 1e-4  # the VNNI kernel: int16 activations
    torch.testing.assert_close(k.apply(lin, x), F.linear(x, k.dequantize(), lin.bias),
                               rtol=tol, atol=tol)


def vnni_panels(kind, lin, group):
    """kind's checkpoint tensors for lin's weight, its panels, and a matmul over them"""
    if kind == "int8":
        q, scale = schemes.quantize_int8(lin.weight.detach(), group)
        tensors = {"qweight": q, "scale": scale}
        g = q.shape[1] // scale.shape[1]
        panels = csrc.int8_to_vnni(q, scale, g)
        unpacked = dict(zip(tensors, csrc.int8_from_vnni(*panels, q.shape[0]), strict=True))
        return tensors, panels, unpacked, lambda x: csrc.int8_vnni_gemm(
            x.contiguous(), *panels, q.shape[0], lin.bias, g)
    q, scale, mins = schemes.quantize_int4(lin.weight.detach(), group)
    tensors = {"qweight": q, "scale": scale, "min": mins}
    panels = csrc.int4_to_vnni(q, scale, mins, group)
    unpacked = dict(zip(tensors, csrc.int4_from_vnni(*panels, q.shape[0]), strict=True))
    return tensors, panels, unpacked, lambda x: csrc.int4_vnni_gemm(
        x.contiguous(), *panels, q.shape[0], lin.bias, group)


@needs_csrc
@pytest.mark.parametrize("kind,group", [("int8", None), ("int8", 32), ("int8", 64),
                                        ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("rows", [1, 5, 11, 12, 13, 30])
@pytest.mark.parametrize("bias", [True, False])
def test_vnni_panels_match_int16_activations_times_dequantized_weights(kind, group, rows,
                                                                        bias):
    # vnni_panels.c (VNNI where the CPU has it, its vpmaddwd twin elsewhere: same results):
    # 98 channels leave a partial last panel of 16; 320 inputs, per-channel scales or groups
    # of 32 / 64 inputs; row tiles of 12 (6 without VNNI) and their remainders.
    lin = layer(k=320, bias=bias)
    tensors, panels, unpacked, matmul = vnni_panels(kind, lin, group)
    assert panels[0].shape[:3] == (7, 160, 16)
    for name, t in tensors.items():  # the layout is invertible
        assert torch.equal(unpacked[name], t), name
    assert not panels[0][6, :, 2:].any()  # channels past N are zero
    x = torch.randn(rows + 4, 320)[2:2 + rows] * 3
    x[0, :32] = 0  # an all-zero block (scale 0)
    x[-1, 40] = 200.0  # an outlier dominating its block
    out = matmul(x)
    kernel = KERNELS[kind](tensors)
    expected = F.linear(schemes.fake_quantize_blocks(x), kernel.dequantize(), lin.bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    if kind == "int8" or group == 32:  # gemm.c's int16-activation kernels: the same rounding
        xc = x.contiguous()
        old = (csrc.int8_gemm_int_dot(xc, *tensors.values(), lin.bias, 320 // tensors[
            "scale"].shape[1]) if kind == "int8" else csrc.int4_gemm_int_dot(
            xc, *tensors.values(), lin.bias))
        torch.testing.assert_close(out, old, rtol=1e-5, atol=1e-5)
    for i in {0, rows // 2, rows - 1}:  # a row's sums do not depend on the rows beside it
        assert torch.equal(matmul(x[i:i + 1]), out[i:i + 1])


@needs_csrc
@pytest.mark.parametrize("kernel", [Int8Kernel, Int4Kernel])
@pytest.mark.parametrize("vnni", [True, False])
def test_weight_only_kernels_keep_one_weight_layout(kernel, vnni, monkeypatch):
    # With VNNI (forced here where the CPU lacks it: the portable build gives the same
    # results) only the panels stay in memory; the checkpoint tensors unpack from them.
    monkeypatch.setattr(csrc, "vnni_native", lambda: vnni)
    lin = layer()
    tensors, panels, _, matmul = vnni_panels(kernel.method, lin, 32)
    k = kernel(tensors)
    assert k.vnni is vnni
    assert k.name == f"{kernel.method}-cpu-" + ("vnni" if vnni else "intdot")
    for name, t in tensors.items():
        assert torch.equal(k.tensors[name], t), name
    layouts = panels if vnni else tensors.values()
    assert k.weight_bytes() == sum(t.numel() * t.element_size() for t in layouts)
    for rows in (1, 40, linear_kernels.INT8_MAX_ROWS + 3):
        x = torch.randn(rows, 128)
        expected = F.linear(schemes.fake_quantize_blocks(x), k.dequantize(), lin.bias)
        out = k.apply(lin, x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        if vnni:
            assert torch.equal(out, matmul(x))


@needs_csrc
def test_int_dot_falls_back_where_shapes_do_not_fit():
    assert not Int4Kernel.from_weight(layer().weight.detach(), group=64).int_dot
    odd = Int8Kernel.from_weight(layer(k=72).weight.detach(), group=8)  # groups of 8
    assert odd.fast and not odd.int_dot


@pytest.mark.parametrize("kernel", [Int8Kernel, Int4Kernel])
def test_weight_only_kernels_without_compiled_code_and_for_prompts(kernel, monkeypatch):
    lin = layer()
    k = kernel.from_weight(lin.weight.detach())
    x = torch.randn(linear_kernels.INT8_MAX_ROWS + 3, 128)  # prompt rows: GEMM path
    expected = x @ k.dequantize().T + lin.bias
    torch.testing.assert_close(k.apply(lin, x), expected, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(csrc, "available", lambda: False)
    slow = kernel.from_weight(lin.weight.detach())
    assert not slow.fast and slow.name.endswith("dequant")
    torch.testing.assert_close(slow.apply(lin, x[:2]), expected[:2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 6, 40])
def test_a8w8_fast_path_matches_its_emulation(static, rows):
    lin = layer()
    x = torch.randn(rows, 128)
    x[:, 3] *= 20  # an outlier channel, as LLM activations have
    smooth = schemes.smoothing_factors(x.abs().amax(0), lin.weight.detach())
    act = None
    if static:
        act = torch.stack([(x / smooth).min(), (x / smooth).max()])
    k = A8W8Kernel.from_weight(lin.weight.detach(), smooth, act)
    assert k.packed is not None
    fast, emulated = k.apply(lin, x), k.reference(lin, x)
    exact = F.linear(x, lin.weight, lin.bias)
    scale = exact.abs().max()
    # The emulation rounds exactly as fbgemm / oneDNN do: only summation order differs.
    assert (fast - emulated).abs().max() <= 1e-5 * scale
    assert (emulated - exact).abs().max() <= 0.1 * scale  # 7-bit activations: coarse


def test_smoothing_moves_outliers_into_weights_exactly():
    w, x = torch.randn(16, 32), torch.randn(5, 32)
    x[:, 7] *= 50
    s = schemes.smoothing_factors(x.abs().amax(0), w)
    torch.testing.assert_close((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-4)
    assert (x / s).abs().amax(0).max() < x.abs().amax(0).max() / 5


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_dequantizing_path_is_close_to_float(per_channel, static):
    lin = layer()
    x = torch.randn(7, 128)
    k = Fp8Kernel.from_weight(lin.weight.detach(), per_channel,
                              x.abs().max() if static else None)
    assert k.qweight.dtype == torch.float8_e4m3fn
    assert k.scale.shape == ((98,) if per_channel else (1,))
    exact = F.linear(x, lin.weight, lin.bias)
    assert (k.apply(lin, x) - exact).norm() / exact.norm() < 0.06


def test_kernel_names_say_which_path_runs():
    lin = layer()
    names = {cls.method: cls.from_weight(lin.weight.detach()).name
             for cls in (Int8Kernel, Int4Kernel, A8W8Kernel, Fp8Kernel)}
    assert names["a8w8"] == "a8w8-cpu" and names["fp8"] == "fp8-dequant"
    if csrc.available():
        path = "vnni" if csrc.vnni_native() else "intdot"
        assert names["int8"] == f"int8-cpu-{path}" and names["int4"] == f"int4-cpu-{path}"


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_scaled_mm_path_matches_its_dequantizing_path(per_channel, static, bias):
    # The GPU path (`torch._scaled_mm`), run here through torch's CPU implementation.
    lin = layer(bias=bias)
    x = torch.randn(7, 128)
    k = Fp8Kernel.from_weight(lin.weight.detach(), per_channel,
                              x.abs().max() if static else None)
    k.scaled_mm = True
    torch.testing.assert_close(k.apply(lin, x), k.reference(lin, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("vnni", [True, False])
def test_int8_offsets_added_on_every_path(monkeypatch, vnni):
    """An int8 layer with per-group offsets (GGUF Q5_1 / Q5_K) equals its dequantized weight
    at decode and prompt row counts, with VNNI panels or gemm.c's layout, and without the
    compiled kernels; it has no compiled decode form."""
    monkeypatch.setattr(csrc, "vnni_native", lambda: vnni)
    lin = layer()
    g = torch.Generator().manual_seed(1)
    tensors = {"qweight": torch.randint(0, 32, (lin.out_features, 128), generator=g,
                                        dtype=torch.int8),
               "scale": torch.rand(lin.out_features, 4, generator=g) * 0.05,
               "offset": torch.randn(lin.out_features, 4, generator=g) * 0.3}
    k = Int8Kernel(tensors)
    weight = (tensors["qweight"].float().view(-1, 4, 32) * tensors["scale"][..., None]
              + tensors["offset"][..., None]).view(-1, 128)
    torch.testing.assert_close(k.dequantize(), weight)
    assert torch.equal(k.tensors["offset"], tensors["offset"])
    assert k.compiled_form() is None
    for rows in (1, 40, linear_kernels.INT8_MAX_ROWS + 3):
        x = torch.randn(rows, 128)
        expected = F.linear(x, weight, lin.bias)
        torch.testing.assert_close(k.apply(lin, x), expected, rtol=1e-3, atol=1e-3)
    monkeypatch.setattr(csrc, "available", lambda: False)
    slow = Int8Kernel(tensors)
    torch.testing.assert_close(slow.apply(lin, x[:3]), expected[:3], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("vnni", [True, False])
@pytest.mark.parametrize("kernel", [Int8Kernel, Int4Kernel])
def test_rows_read_from_either_layout_equal_the_dequantized_weight(monkeypatch, vnni, kernel):
    """A tied embedding's lookups in its quantized LM head (`rows`), from VNNI panels or the
    checkpoint layout: the dequantized weight's rows."""
    monkeypatch.setattr(csrc, "vnni_native", lambda: vnni)
    k = kernel.from_weight(layer(n=50).weight.detach(), group=32)
    ids = torch.tensor([0, 17, 49, 17, 3])
    assert torch.equal(k.rows(ids), k.dequantize()[ids])


@needs_csrc
@pytest.mark.parametrize("vnni", [True, False])
def test_int8_groups_of_16_take_the_panels(monkeypatch, vnni):
    """GGUF Q6_K / Q3_K keep a scale per 16 inputs: the VNNI panels sum each 32-input
    block's halves apart (int16 activations, as for groups of 32); elsewhere gemm.c's
    float-activation kernel serves them."""
    monkeypatch.setattr(csrc, "vnni_native", lambda: vnni)
    lin = layer()
    k = Int8Kernel.from_weight(lin.weight.detach(), group=16)
    assert k.group == 16 and k.name == ("int8-cpu-vnni" if vnni else "int8-cpu")
    for rows in (1, 5, 13, linear_kernels.INT8_MAX_ROWS + 3):
        x = torch.randn(rows, 128)
        rounded = schemes.fake_quantize_blocks(x) if vnni else x
        expected = F.linear(rounded, k.dequantize(), lin.bias)
        torch.testing.assert_close(k.apply(lin, x), expected, rtol=1e-4, atol=1e-4)
    assert k.compiled_form() is not None
