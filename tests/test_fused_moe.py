"""Fused experts (layers/fused_moe.py) against the per-expert loop of layers/moe.py, and MoE
models on them against transformers; on a machine without a GPU in Triton's interpreter."""

import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.layers.fused_moe import BLOCK_M, FusedExperts, align
from tokenmill.layers.moe import SparseMoE, grouped_experts, softmax_top_k
from tokenmill.models.llama import MLP
from tokenmill.platforms.cpu import CpuPlatform

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
    assert mlps[1].down_proj.weight.data_ptr() == fused.w2[1].data_ptr()  # views, no copy
    torch.testing.assert_close(fused(x, weights, ids), ref, atol=1e-5, rtol=1e-5)
    assert BLOCK_M >= 16  # (tl.dot's smallest tile)


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
    monkeypatch.setattr(CpuPlatform, "supports_graphs", True)
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
