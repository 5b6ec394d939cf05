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


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("setting,splits", [((4, 128, 4), 1), ((16, 128, 4), 1),
                                            ((32, 256, 4), 1), ((16, 128, 4), 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_linear(rows, setting, splits, bias):
    # decode's linears (layers/linear.py SkinnyKernel): every launch shape against F.linear;
    # 300 inputs and 70 outputs leave partial K and column blocks; splits: K ranges summed by
    # atomics (bench/gemv_sweep.py's variant)
    if rows > 1 and setting[0] < 16:
        pytest.skip("tl.dot takes 16 columns at least (the engine's row settings have them)")
    torch.manual_seed(rows)
    x = torch.randn(rows, 300 + 4, device=DEVICE)[:, :300]  # strided rows
    w = torch.randn(70, 300, device=DEVICE)
    b = torch.randn(70, device=DEVICE) if bias else None
    out = triton_ops.skinny_linear(x, w, b, setting, splits)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gated_matches_the_product_then_the_gated_kernel(dtype, rows, bias):
    # a merged gate|up layer's product and SiLU gating in one launch (MLP._gated), rounded
    # as F.linear's 16-bit product and then the gated kernel round
    torch.manual_seed(rows)
    x = torch.randn(rows, 300, device=DEVICE).to(dtype)
    w = (torch.randn(2 * 70, 300, device=DEVICE) * 0.1).to(dtype)
    b = torch.randn(2 * 70, device=DEVICE).to(dtype) if bias else None
    setting = (4, 128, 4) if rows == 1 else (16, 128, 4)
    out = triton_ops.skinny_linear(x, w, b, setting, gated=True)
    product = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    gate, up = product.chunk(2, dim=-1)
    ref = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    assert out.shape == (rows, 70)
    # (float32: the products' sums in another order; 16-bit: that, and a rounding step)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else exact(dtype)
    torch.testing.assert_close(out, ref, **tol)


def test_skinny_linear_engine_settings_are_valid():
    # every autotuned setting of the engine's (tried on a GPU at the first call) computes the
    # product: one-row settings with one row, 16-row ones with 2 and 16
    kernels = triton_ops.kernels()
    torch.manual_seed(0)
    w, b = torch.randn(40, 520, device=DEVICE), torch.randn(40, device=DEVICE)
    for rows, settings in ((1, kernels.ONE_ROW_SETTINGS), (2, kernels.ROWS_SETTINGS),
                           (16, kernels.ROWS_SETTINGS)):
        x = torch.randn(rows, 520, device=DEVICE)
        for setting in settings:
            torch.testing.assert_close(triton_ops.skinny_linear(x, w, b, setting),
                                       F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning times launches on a GPU")
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_skinny_linear_autotuned_in_a_cuda_graph(rows):
    # the engine's path: the settings timed on the first call, then captured and replayed
    torch.manual_seed(rows)
    x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1152, 896, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(1152, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float(), b.float())
    eager = triton_ops.skinny_linear(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_ops.skinny_linear(x, w, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(eager.float(), ref, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()),
                               atol=2e-2, rtol=1.6e-2)


def test_skinny_kernel_chosen_only_where_asked(monkeypatch):
    from tokenmill.layers import kernel_choice, linear, skinny

    layer = linear.Linear(8, 4)
    layer.weight.data = torch.randn(4, 8, dtype=torch.float16)  # (CPU-packed: float32 only)
    monkeypatch.setattr(skinny.SkinnyKernel, "supports", staticmethod(lambda layer: True))
    monkeypatch.delenv("TOKENMILL_GPU_SKINNY_LINEAR", raising=False)
    kernel_choice.choose_linear_kernels(layer)
    assert type(layer.kernel) is linear.DenseKernel
    monkeypatch.setenv("TOKENMILL_GPU_SKINNY_LINEAR", "1")
    kernel_choice.choose_linear_kernels(layer)
    assert isinstance(layer.kernel, skinny.SkinnyKernel)
    for rows in (3, 20):  # the Triton kernel (interpreted here), then F.linear past 16 rows
        x = torch.randn(rows, 8, dtype=torch.float16)
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()),
                                   atol=2e-3, rtol=2e-3)
    monkeypatch.setenv("TOKENMILL_GPU_SKINNY_LINEAR", "yes")
    with pytest.raises(ValueError, match="TOKENMILL_GPU_SKINNY_LINEAR must be 0 or 1"):
        kernel_choice.choose_linear_kernels(linear.Linear(8, 4))


def test_skinny_kernel_kept_only_where_timed_faster(monkeypatch):
    # per (row count, shape): the faster of the two, timed once; nothing timed (cuBLAS, not
    # kept) while a graph is captured; a kernel failing on the card leaves cuBLAS, kept
    from tokenmill.layers import skinny

    monkeypatch.setattr(skinny, "_FASTER", {})
    times = []

    def timed(mine, theirs):
        def run():
            times.append((mine, theirs))
            return mine, theirs
        return run

    assert skinny.prefer_skinny("a", False, timed(1.0, 2.0))
    assert skinny.prefer_skinny("a", False, timed(9.0, 2.0))  # kept: not timed again
    assert not skinny.prefer_skinny("b", False, timed(3.0, 2.0))
    assert times == [(1.0, 2.0), (3.0, 2.0)]
    assert not skinny.prefer_skinny("c", True, timed(1.0, 2.0))  # capturing
    assert "c" not in skinny._FASTER and len(times) == 2

    def broken():
        raise RuntimeError("no bf16 dot on this card")

    assert not skinny.prefer_skinny("d", False, broken)
    assert skinny._FASTER["d"] is False


def test_skinny_kernel_not_for_cpu_weights():
    from tokenmill.layers import linear, skinny

    layer = linear.Linear(8, 4)
    assert not skinny.SkinnyKernel.supports(layer)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("setting", [(16, 128, 1, 4), (32, 256, 2, 4)])
def test_skinny_matmul_of_the_sweep_matches_linear(rows, setting):
    # bench/gemv_sweep.py times the engine's kernel by setting (K ranges summed by atomics
    # too) against cuBLAS on GPUs; its correctness check, here in the interpreter
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import gemv_sweep

    torch.manual_seed(rows)
    x, w = torch.randn(rows, 300, device=DEVICE), torch.randn(70, 300, device=DEVICE)
    assert gemv_sweep.check(x, w, setting)


def test_engine_with_the_skinny_kernel(tiny_models, monkeypatch):
    # the engine as on a GPU with TOKENMILL_GPU_SKINNY_LINEAR=1: every 16-bit linear's
    # decode steps (and short prompts) through the kernel (qwen2: biased q|k|v), longer
    # prompts through F.linear; the same tokens as the engine on F.linear alone
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers import linear, skinny

    path, _ = tiny_models("qwen2")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 30)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def tokens() -> tuple[list[list[int]], list[str]]:
        llm = LLM(path, dtype="float16", kv_cache_memory_gib=0.01, attention_backend="triton")
        kinds = sorted({type(m.kernel).__name__ for m in llm.engine.core.runner.model.modules()
                        if isinstance(m, linear.Linear)})
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], kinds

    plain, kinds = tokens()
    assert kinds == ["DenseKernel"]
    calls = []
    original = triton_ops.skinny_linear
    monkeypatch.setattr(triton_ops, "skinny_linear",
                        lambda x, *a, **k: calls.append(x.shape[0]) or original(x, *a, **k))
    monkeypatch.setattr(skinny.SkinnyKernel, "supports", staticmethod(lambda layer: True))
    # (on a GPU: the kernel on every shape, not only where it was timed faster)
    monkeypatch.setattr(skinny, "_faster", lambda *args: True)
    monkeypatch.setenv("TOKENMILL_GPU_SKINNY_LINEAR", "1")
    on_kernel, kinds = tokens()
    assert kinds == ["SkinnyKernel"]
    assert on_kernel == plain
    assert calls and max(calls) <= 16
    seen = []
    monkeypatch.setattr(triton_ops, "skinny_linear", lambda x, *a, gated=False, **k:
                        seen.append(gated) or original(x, *a, gated=gated, **k))
    assert tokens()[0] == plain
    assert True in seen  # the MLP's gate|up and SiLU in one launch
