"""DeepSeek's multi-head latent attention: the paged cache holds one latent + rotary row per
token and layer; the absorbed computation equals expanding the latents into per-head K/V;
whole models match transformers (q through q_a|q_b or one q_proj) and one rank."""

import random

import pytest
import torch
from helpers import hf_greedy, make_model, paged_step

from tokenmill import LLM, SamplingParams
from tokenmill.attention.mla import mla_attention
from tokenmill.models.deepseek import mla_reference

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8], list(range(300, 333))]


def test_the_cache_holds_one_latent_row_per_token_and_layer(tiny_models):
    path, hf = tiny_models("deepseek_v3")
    config = hf.config
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        runner = llm.engine.core.runner
        attn = runner.model.attention_layers()[0]
        per_token_layer = runner.block_bytes / (runner.block_size * runner.num_layers)
        assert attn.k_cache.shape[1:] == (runner.block_size, 1,
                                          config.kv_lora_rank + config.qk_rope_head_dim)
        assert attn.v_cache.numel() == 0
    assert per_token_layer == (config.kv_lora_rank + config.qk_rope_head_dim) * 4


def test_absorbed_attention_equals_the_expanded_reference(tiny_models):
    """Random latents in the cache, mixed decodes and prompt chunks with cached context."""
    path, _ = tiny_models("deepseek_v3")
    with LLM(path, kv_cache_memory_gib=0.01, device="cpu") as llm:  # (CPU-built metadata)
        layer = llm.engine.core.runner.model.attention_layers()[0]
        rng = random.Random(0)
        meta = paged_step([(9, 1), (30, 1), (0, 7), (12, 5)], 16, 20, rng)
        layer.k_cache.normal_()
        t = meta.query_start_loc[-1]
        q = torch.randn(t, layer.num_heads, layer.nope)
        q_pe = torch.randn(t, layer.num_heads, layer.rope_dim)
        w_uk, w_uv = layer.absorbed()
        absorbed = torch.einsum("thr,hvr->thv", mla_attention(
            torch.einsum("thn,hnr->thr", q, w_uk), q_pe, layer.k_cache, meta, layer.rank,
            layer.scale), w_uv)
        torch.testing.assert_close(absorbed, mla_reference(layer, q, q_pe, meta),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seqs", [
    [(9, 1), (30, 1), (0, 7), (12, 5)],  # decodes, a fresh prompt, a chunk with context
    [(9, 1), (0, 1), (40, 1), (17, 1)],  # decodes only (one with an empty context)
    [(0, 7), (12, 5)],  # prompts only
    # a decode with drafts before plain decodes (speculative decoding): no leading decodes
    [(9, 3), (30, 1), (0, 7), (12, 1)]])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float8_e4m3fn)])
def test_cpu_backend_batches_decodes_as_the_one_sequence_reference(seqs, dtype, cache_dtype,
                                                                  monkeypatch):
    """The CPU backend's latent attention (a step's decodes batched over their gathered,
    padded rows: all in one group, one per group, and groups of a few) against
    attention/mla.py's reference, one sequence at a time."""
    from tokenmill.attention import torch_sdpa
    from tokenmill.attention.torch_sdpa import TorchSDPABackend

    heads, rank, rope = 5, 32, 16
    meta = paged_step(seqs, 16, 24, random.Random(1))
    cache = torch.randn(24, 16, 1, rank + rope).to(cache_dtype)
    t = meta.query_start_loc[-1]
    q_latent, q_pe = torch.randn(t, heads, rank, dtype=dtype), torch.randn(t, heads, rope,
                                                                           dtype=dtype)
    ref = mla_attention(q_latent, q_pe, cache, meta, rank, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row_bytes = 48 * (rank + rope) * q_latent.element_size()  # (~ a sequence: groups of 3-4)
    for budget in (torch_sdpa.MLA_GATHER_BYTES, 1, 3 * row_bytes):
        monkeypatch.setattr(torch_sdpa, "MLA_GATHER_BYTES", budget)
        out = TorchSDPABackend().mla(q_latent, q_pe, cache, meta, rank, 0.3)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_leading_decodes_are_counted_from_the_first_sequence():
    from tokenmill.attention.backend import leading_decodes

    assert leading_decodes([9, 30, 0], [10, 31, 7]) == 2
    assert leading_decodes([9, 30, 12], [12, 31, 13]) == 0  # (drafted, then plain decodes)
    assert leading_decodes([], []) == 0


def test_one_q_projection_and_two_ranks(tmp_path, tiny_models):
    """q_lora_rank None (DeepSeek-V2-Lite's single q_proj) matches transformers; heads split
    over two ranks (the latent cache whole on each) match one rank."""
    path = str(tmp_path / "q_proj")
    hf = make_model(path, "deepseek_v3", q_lora_rank=None)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        one = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert one == [hf_greedy(hf, p, 10) for p in PROMPTS]
    with LLM(path, kv_cache_memory_gib=0.01, tensor_parallel_size=2) as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert two == one


def test_an_int8_kv_cache_is_refused_by_name(tiny_models):
    path, _ = tiny_models("deepseek_v3")
    with pytest.raises(ValueError, match="int8 KV cache is not built for DeepSeek"):
        LLM(path, kv_cache_memory_gib=0.01, kv_cache_dtype="int8")


def test_quantization_reaches_the_latent_projections_and_experts(tiny_models):
    """int8: q_a / q_b / kv_a / o projections and every expert quantized (kv_b, absorbed,
    and the router stay float); two ranks give one rank's tokens."""
    path, _ = tiny_models("deepseek_v3")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = []
    for tp in (1, 2):
        with LLM(path, kv_cache_memory_gib=0.01, quantization="int8",
                 tensor_parallel_size=tp) as llm:
            layer = llm.engine.core.runner.model.model.layers[1]
            attn, moe = layer.self_attn, layer.mlp
            for linear in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj,
                           moe.experts[5].gate_up_proj, moe.shared_expert.down_proj):
                assert linear.kernel.name.startswith("int8"), linear
            assert attn.kv_b_proj.weight is not None  # (read as it is: absorbed)
            assert not moe.gate.kernel.name.startswith(("int", "fp8", "a8w8"))
            results.append([o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)])
    assert results[1] == results[0]


def test_pipeline_stages_and_preemption_match_one_rank(tiny_models):
    """Latent attention under two pipeline stages, and through chunked prefill, prefix hits
    and preemption: one rank's / transformers' tokens."""
    path, hf = tiny_models("deepseek_v3")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01, pipeline_parallel_size=2) as llm:
        staged = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert staged == [hf_greedy(hf, p, 10) for p in PROMPTS]
