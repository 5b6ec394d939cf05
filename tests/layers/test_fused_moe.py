"""Fused experts (layers/fused_moe.py) against the per-expert loop of layers/moe.py, and MoE
models on them against transformers; on a machine without a GPU in Triton's interpreter."""

import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.layers.fused_moe import BLOCK_M, FusedExperts, align
from tokenmill.layers.moe import SparseMoE, grouped_experts, softmax_top_k
from tokenmill.models.llama import MLP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_sorts_by_expert_and_pads_each_run():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 1]], device=DEVICE)  # 4 tokens, top-2
    slots, block_expert = align(ids, 5, block_m=4)
    n = ids.numel()
    assert slots.numel() == -(-(n + 5 * 3) // 4) * 4
    runs = [(int(e), slots[b * 4:(b + 1) * 4].tolist()) for b, e in enumerate(block_expert)]
    flat = ids.reshape(-1).tolist()
    seen = []
    for expert, block in runs:
        real = [s for s in block if s < n]
        if expert < 0:
            assert not real  # past the last expert: padding only
            continue
        assert all(flat[s] == expert for s in real) and real == sorted(real)
        seen += real
    assert sorted(seen) == list(range(n))  # every assignment once
    assert [e for e, _ in runs if e >= 0] == [0, 1, 2, 3]  # expert 4 has none: no block


class _Cfg:
    hidden_size, intermediate_size, mlp_bias = 32, 48, False


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 4), (5, 2, 8), (37, 3, 6)])
def test_fused_experts_match_the_loop(tokens, top_k, experts):
    torch.manual_seed(tokens)
    mlps = torch.nn.ModuleList(MLP(_Cfg()) for _ in range(experts)).to(DEVICE)
    for m in mlps:
        for layer in (m.gate_up_proj, m.down_proj):
            layer.weight.data.normal_(0, 0.3)
    x = torch.randn(tokens, 32, device=DEVICE)
    weights, ids = softmax_top_k(torch.randn(tokens, experts, device=DEVICE), top_k, True)
    ref = grouped_experts(x, weights, ids, mlps)
    assert FusedExperts.servable(mlps)
    fused = FusedExperts(mlps)
    assert mlps[1].down_proj.weight.data_ptr() == fused.w2.w[1].data_ptr()  # views, no copy
    torch.testing.assert_close(fused(x, weights, ids), ref, atol=1e-5, rtol=1e-5)
    assert BLOCK_M >= 16  # (tl.dot's smallest tile)


class _WideCfg:
    hidden_size, intermediate_size, mlp_bias = 64, 128, False


@pytest.mark.parametrize("method,group", [("int8", None), ("int8", 32), ("int4", 32),
                                          ("int4", 64)])
def test_quantized_fused_experts_match_the_loop(method, group):
    """int8 (per channel or per group) and int4 experts, dequantized in the kernel, against
    the loop over each expert's own quantized kernel (the same rounded weights)."""
    from tokenmill.quantization.linear_kernels import Int4Kernel, Int8Kernel

    torch.manual_seed(3)
    mlps = torch.nn.ModuleList(MLP(_WideCfg()) for _ in range(6)).to(DEVICE)
    for m in mlps:
        for layer in (m.gate_up_proj, m.down_proj):
            weight = layer.weight.data.normal_(0, 0.3)
            layer.use_kernel(Int8Kernel.from_weight(weight, group) if method == "int8"
                             else Int4Kernel.from_weight(weight, group))
    x = torch.randn(21, 64, device=DEVICE)
    weights, ids = softmax_top_k(torch.randn(21, 6, device=DEVICE), 2, True)
    ref = grouped_experts(x, weights, ids, mlps)
    assert FusedExperts.servable(mlps)
    fused = FusedExperts(mlps)
    assert fused.w2.quant == (8 if method == "int8" else 4)
    # the experts' kernels read views of the stacks: no second copy
    assert mlps[4].gate_up_proj.kernel.qweight.data_ptr() == fused.w13.w[4].data_ptr()
    torch.testing.assert_close(grouped_experts(x, weights, ids, mlps), ref)
    # (the loop's compiled CPU kernels may round activations to int16 per 32 inputs)
    torch.testing.assert_close(fused(x, weights, ids), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_fused_experts_are_weight_only(per_channel):
    """float8 experts: their weights (channel or tensor scales) dequantized in the kernel,
    activations kept as they are; against the loop over the dequantized weights."""
    from tokenmill.quantization.activation_kernels import Fp8Kernel

    torch.manual_seed(4)
    mlps = torch.nn.ModuleList(MLP(_WideCfg()) for _ in range(5)).to(DEVICE)
    ref_mlps = torch.nn.ModuleList(MLP(_WideCfg()) for _ in range(5)).to(DEVICE)
    for m, r in zip(mlps, ref_mlps):
        for layer, ref in ((m.gate_up_proj, r.gate_up_proj), (m.down_proj, r.down_proj)):
            kernel = Fp8Kernel.from_weight(layer.weight.data.normal_(0, 0.3), per_channel)
            ref.weight.data = kernel.dequantize()
            layer.use_kernel(kernel)
    x = torch.randn(13, 64, device=DEVICE)
    weights, ids = softmax_top_k(torch.randn(13, 5, device=DEVICE), 2, True)
    assert FusedExperts.servable(mlps)
    fused = FusedExperts(mlps)
    assert mlps[2].down_proj.kernel.qweight.data_ptr() == fused.w2.w[2].data_ptr()
    torch.testing.assert_close(fused(x, weights, ids),
                               grouped_experts(x, weights, ids, ref_mlps),
                               atol=1e-5, rtol=1e-5)


def test_experts_with_gguf_offsets_keep_the_loop():
    from tokenmill.quantization.linear_kernels import Int8Kernel

    mlps = torch.nn.ModuleList(MLP(_WideCfg()) for _ in range(2))
    for m in mlps:
        for layer in (m.gate_up_proj, m.down_proj):
            q = torch.randint(0, 32, layer.weight.shape, dtype=torch.int8)
            groups = layer.weight.shape[1] // 32
            layer.use_kernel(Int8Kernel({"qweight": q, "scale": torch.rand(q.shape[0], groups),
                                         "offset": torch.rand(q.shape[0], groups)}))
    assert not FusedExperts.servable(mlps)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_moe_model_on_fused_experts_equals_the_loop(tiny_models, monkeypatch,
                                                              method):
    from tokenmill.layers.linear import CpuPackedKernel

    path = tiny_models("qwen3_moe")[0]
    prompts = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 50))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(fused: bool):
        llm = LLM(path, kv_cache_memory_gib=0.01, attention_backend="triton",
                  quantization=method)
        blocks = [m for m in llm.engine.core.runner.model.modules()
                  if isinstance(m, SparseMoE)]
        assert blocks and all((b.fused is not None) == fused for b in blocks)
        return [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    fuse = SparseMoE.fuse_experts
    # the per-expert loop as the reference, on a GPU too (where experts fuse by default)
    monkeypatch.setattr(SparseMoE, "fuse_experts", lambda self: None)
    looped = run(False)
    monkeypatch.setattr(SparseMoE, "fuse_experts", lambda self: fuse(self, force=True))
    monkeypatch.setattr(CpuPackedKernel, "supports", staticmethod(lambda layer: False))
    assert run(True) == looped


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_moe_models_on_fused_experts_match_transformers(tiny_models, monkeypatch, arch):
    """Every router (softmax top-k, Qwen2-MoE's gated shared expert, DeepSeek-V3's grouped
    sigmoid with latent attention) over fused experts, decode steps graph-ready."""
    from tokenmill.layers.linear import CpuPackedKernel

    fuse = SparseMoE.fuse_experts
    monkeypatch.setattr(SparseMoE, "fuse_experts", lambda self: fuse(self, force=True))
    # float weights as a GPU keeps them (the CPU packs them for oneDNN)
    monkeypatch.setattr(CpuPackedKernel, "supports", staticmethod(lambda layer: False))
    # decode steps in CUDA-graph buckets (run eagerly without a GPU), padding rows routed too
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    path, hf = tiny_models(arch)
    llm = LLM(path, kv_cache_memory_gib=0.01, attention_backend="triton", max_num_seqs=4)
    blocks = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.fused is not None and not b.host_sync for b in blocks)
    assert llm.engine.core.runner.graphs is not None
    prompts = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 50)), [9, 8, 7]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
