"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek): routing and the
grouped expert run against a slow per-token reference, then whole models against
transformers and against one rank through chunked prefill, prefix hits, preemption (the
other new architectures too: Gemma 2 / 3, Phi-3), tensor / pipeline / expert parallel,
quantization and GGUF files."""

import pytest
import torch
from helpers import BIASED, STATE, hf_greedy
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.layers.moe import grouped_experts, grouped_top_k, softmax_top_k

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8], list(range(300, 333))]


def reference_moe(x, logits, experts, top_k, renormalize):
    """Token by token: softmax over the experts, the k largest (lowest index first on ties),
    each expert's output times its weight, summed."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=-1)
        chosen = sorted(range(len(probs)), key=lambda e: (-float(probs[e]), e))[:top_k]
        total = sum(float(probs[e]) for e in chosen) if renormalize else 1.0
        for e in chosen:
            out[t] += float(probs[e]) / total * experts[e](x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_match_a_per_token_reference_with_ties(renormalize):
    torch.manual_seed(0)
    experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 24), nn.SiLU(), nn.Linear(24, 16))
                            for _ in range(6))
    x = torch.randn(40, 16)
    logits = torch.randn(40, 6)
    logits[::5] = 0.5  # every expert tied
    logits[1::5, 2:4] = 3.0  # two tied at the top
    with torch.no_grad():
        weights, ids = softmax_top_k(logits, 2, renormalize)
        ours = grouped_experts(x, weights, ids, experts)
        theirs = reference_moe(x, logits, experts, 2, renormalize)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ids[1].tolist() == [2, 3] and ids[0].tolist() == [0, 1]  # ties: lowest index


def reference_grouped(logits, bias, top_k, n_group, topk_group, scaling):
    """Token by token, DeepSeek-V3's rule as its paper states it (lowest index on ties)."""
    experts = logits.shape[1]
    size = experts // n_group
    weights, ids = [], []
    for scores in torch.sigmoid(logits.double()):
        biased = [float(scores[e] + bias[e]) for e in range(experts)]
        group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2])
                       for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        allowed = [e for e in range(experts) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: (-biased[e], e))[:top_k]
        total = sum(float(scores[e]) for e in chosen)
        weights.append([float(scores[e]) / total * scaling for e in chosen])
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


def test_grouped_routing_matches_a_per_token_reference_with_ties():
    torch.manual_seed(1)
    logits, bias = torch.randn(30, 16), torch.randn(16) * 0.3
    logits[::6] = 0.0  # every expert's score tied (bias decides)
    bias[4:8] = 0.0
    logits[3, 4:8] = 1.0  # tied inside a group
    weights, ids = grouped_top_k(logits, 3, 4, 2, bias, True, 2.5)
    ref_weights, ref_ids = reference_grouped(logits, bias, 3, 4, 2, 2.5)
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-5, atol=1e-6)


def test_softmax_group_routing_matches_a_per_token_reference():
    """DeepSeek-V2's group-limited greedy: groups ranked by their best expert."""
    from tokenmill.layers.moe import softmax_grouped_top_k

    torch.manual_seed(2)
    logits = torch.randn(25, 12)
    logits[::5] = 0.0  # all tied
    weights, ids = softmax_grouped_top_k(logits, 2, 3, 2, False, 1.5)
    for t, probs in enumerate(torch.softmax(logits.double(), dim=-1)):
        best = [max(float(p) for p in probs[g * 4:(g + 1) * 4]) for g in range(3)]
        groups = sorted(range(3), key=lambda g: (-best[g], g))[:2]
        chosen = sorted((e for e in range(12) if e // 4 in groups),
                        key=lambda e: (-float(probs[e]), e))[:2]
        assert ids[t].tolist() == chosen
        torch.testing.assert_close(weights[t].double(), probs[chosen] * 1.5, rtol=1e-5,
                                   atol=1e-6)


def generate(path, prompts, params, **engine):
    with LLM(path, kv_cache_memory_gib=0.01, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        stats = llm.engine.core.stats()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gemma2",
                                  "gemma3", "phi3", *BIASED])
def test_chunked_prefill_prefix_hits_and_preemption_match_transformers(tiny_models, arch):
    path, hf = tiny_models(arch)
    shared = list(range(20, 84))
    prompts = [shared + [i, i + 1, i + 2] for i in range(100, 112)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    tokens, stats = generate(path, prompts, params, max_num_batched_tokens=16,
                             num_kv_blocks=16)
    # (a model with state layers keeps prefix caching off: core/kv_cache_manager.py)
    assert stats.num_preemptions > 0 and (stats.prefix_hit_tokens > 0) != (arch in STATE)
    assert tokens == [hf_greedy(hf, p, 30) for p in prompts]


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_experts_split_across_ranks_match_one_rank(tiny_models, layout):
    """Qwen2-MoE (a gated shared expert, then a dense layer): each rank holds its share of
    every expert; one rank's tokens."""
    path, _ = tiny_models("qwen2_moe")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    one, _ = generate(path, PROMPTS, params)
    split, _ = generate(path, PROMPTS, params, **layout)
    assert split == one


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_experts_are_quantized_and_the_router_is_not(tiny_models, method):
    path, _ = tiny_models("qwen3_moe")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01, quantization=method) as llm:
        moe = llm.engine.core.runner.model.model.layers[0].mlp
        assert moe.experts[0].gate_up_proj.kernel.name.startswith(method)
        assert moe.experts[3].down_proj.kernel.name.startswith(method)
        assert not moe.gate.kernel.name.startswith(("int", "fp8", "a8w8"))
        one = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    two, _ = generate(path, PROMPTS, params, quantization=method, tensor_parallel_size=2)
    assert two == one


@pytest.mark.parametrize("arch,qtype", [("qwen2_moe", None), ("qwen3_moe", None),
                                        ("qwen3_moe", "Q8_0"), ("qwen2_moe", "Q4_1")])
def test_gguf_mixture_of_experts_files(tiny_models, tmp_path, monkeypatch, arch, qtype):
    """llama.cpp's qwen2moe / qwen3moe files (every expert of a layer in one tensor, a
    dense layer without a router): transformers' tokens in float; Q8_0 / Q4_1 experts kept
    as blocks give the tokens of the same file expanded to float."""
    from gguf import GGMLQuantizationType

    from tokenmill import csrc
    from tokenmill.convert.gguf_writer import write_gguf
    from tokenmill.loading import gguf as gguf_loader

    hf_path, hf = tiny_models(arch)
    path = str(tmp_path / f"{arch}.gguf")
    kind = None if qtype is None else GGMLQuantizationType[qtype]
    write_gguf(path, arch.replace("_", ""), hf.state_dict(), hf.config,
               lambda name: kind if "_exps" in name else None)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run():
        gguf_loader._reader.cache_clear()
        with LLM(path, tokenizer=hf_path, kv_cache_memory_gib=0.01) as llm:
            expert = llm.engine.core.runner.model.model.layers[0].mlp.experts[0]
            return expert.down_proj.kernel.name, [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    kernel, tokens = run()
    if qtype is None:
        assert tokens == [hf_greedy(hf, p, 10) for p in PROMPTS]
        return
    if not csrc.available() or torch.cuda.is_available():
        pytest.skip("blocks are kept only for the compiled CPU kernels (GPUs expand them)")
    assert kernel.startswith("int8" if qtype == "Q8_0" else "int4")
    monkeypatch.setattr(csrc, "available", lambda: False)  # every block expanded to float
    assert run()[1] == tokens


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_expert_parallel_ranks_hold_whole_experts_and_match_one_rank(tiny_models, arch):
    """--enable-expert-parallel: rank r holds experts r, r + 2, .. whole (reading only
    theirs from the checkpoint); the tokens of one rank."""
    from tokenmill.layers.moe import OtherRankExpert, SparseMoE

    path, _ = tiny_models(arch)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    one, _ = generate(path, PROMPTS, params)
    with LLM(path, kv_cache_memory_gib=0.01, tensor_parallel_size=2,
             enable_expert_parallel=True) as llm:
        moe = next(m for m in llm.engine.core.runner.model.modules()
                   if isinstance(m, SparseMoE))
        held = [not isinstance(e, OtherRankExpert) for e in moe.experts]
        assert held == [e % 2 == 0 for e in range(len(held))]
        size = moe.experts[0].down_proj.in_features  # whole: not split across the ranks
        assert moe.experts[0].gate_up_proj.out_features == 2 * size
        two = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert two == one


def test_the_flag_reaches_the_engine_config():
    from tokenmill.config.server import build_server_config

    assert build_server_config(["--enable-expert-parallel", "-tp", "2"], {}).engine \
        .enable_expert_parallel
    assert not build_server_config([], {}).engine.enable_expert_parallel
