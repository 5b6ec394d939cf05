"""Variants of the second round of families (issue 64) beyond tests/models/test_models.py's
shared checks: partial and interleaved rotary against transformers' own functions, Phi's
q/k LayerNorms, OLMo 2's whole-projection norms over a key/value head two ranks share,
GLM-4.5 configs naming MTP layers the checkpoint lacks."""

import pytest
import torch
from helpers import hf_greedy, make_model
from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as glm_rotary
from transformers.models.phi.modeling_phi import apply_rotary_pos_emb as neox_rotary

from tokenmill import LLM, SamplingParams
from tokenmill.layers.norm import LayerNorm
from tokenmill.layers.rotary import RotaryEmbedding, head_order

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70))]


@pytest.mark.parametrize("head_dim,factor,interleaved", [
    (16, 0.4, False), (80, 0.4, False), (16, 0.5, True), (128, 0.5, True), (16, 1.0, True),
    (32, 0.25, False)])
def test_reordered_full_width_rotation_gives_the_checkpoints_scores(head_dim, factor,
                                                                    interleaved):
    """q and k rotated the checkpoint's way (transformers' functions: Neox on the first
    dimensions, or GLM's interleaved pairs) score the same as q and k reordered and rotated
    at full width with the partial table."""
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}
    rotated = int(head_dim * factor)
    positions = torch.tensor([0, 1, 7, 100, 511])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 3, head_dim, generator=gen)
    k = torch.randn(len(positions), 3, head_dim, generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotated, 2).float() / rotated))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [T, 1, rotated]
    if interleaved:
        ref_q, ref_k = glm_rotary(q, k, cos[:, 0], sin[:, 0], unsqueeze_dim=1)
    else:
        rq, rk = neox_rotary(q[..., :rotated], k[..., :rotated], cos[:, 0], sin[:, 0],
                             unsqueeze_dim=1)
        ref_q = torch.cat([rq, q[..., rotated:]], dim=-1)
        ref_k = torch.cat([rk, k[..., rotated:]], dim=-1)
    rope = RotaryEmbedding(head_dim, 512 + 1, params, 512).for_step(positions, torch.float32)
    order = head_order(head_dim, rotated, interleaved)
    assert sorted(order.tolist()) == list(range(head_dim))
    ours_q, ours_k = rope(q[..., order].contiguous()), rope(k[..., order].contiguous())
    ref_scores = torch.einsum("thd,thd->th", ref_q, ref_k)
    torch.testing.assert_close(torch.einsum("thd,thd->th", ours_q, ours_k), ref_scores,
                               atol=1e-5, rtol=1e-5)
    # the dimensions that do not turn are untouched, bit for bit
    still = order[torch.cat([torch.arange(rotated // 2, head_dim // 2),
                             torch.arange(head_dim // 2 + rotated // 2, head_dim)])]
    kept = torch.cat([torch.arange(rotated // 2, head_dim // 2),
                      torch.arange(head_dim // 2 + rotated // 2, head_dim)])
    assert torch.equal(ours_q[..., kept], q[..., still])


def test_full_rotary_keeps_the_heads_as_they_are():
    assert head_order(64, 64, False) is None


def test_layernorm_with_a_residual_adds_then_norms():
    norm = LayerNorm(8, 1e-5)
    norm.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    norm.bias.data.normal_(generator=torch.Generator().manual_seed(2))
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    ref = torch.nn.functional.layer_norm(x + residual, (8,), norm.weight, norm.bias, 1e-5)
    out, summed = norm(x, residual)
    assert torch.equal(out, ref) and torch.equal(summed, x + residual)


@pytest.mark.parametrize("arch,overrides,engine", [
    ("phi", {"qk_layernorm": True}, {}),
    # checkpoints of GLM-4.5 carry their MTP layer; one without it still serves
    ("glm4_moe", {"num_nextn_predict_layers": 1}, {}),
    # one key/value head both ranks hold: each adds its squares, divided by twice the rows
    ("olmo2", {"num_key_value_heads": 1}, {"tensor_parallel_size": 2}),
])
def test_variants_match_transformers(tmp_path, arch, overrides, engine):
    hf = make_model(str(tmp_path), arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(tmp_path), kv_cache_memory_gib=0.01, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("overrides", [
    {"num_local_experts": 0},  # (the shared MLP alone: read as the layer's MLP)
    {"position_embedding_type": "rope"},  # (its attention layers rotate)
])
def test_granite_hybrid_variants_match_transformers(tmp_path, overrides):
    hf = make_model(str(tmp_path), "granitemoehybrid", **overrides)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path), kv_cache_memory_gib=0.01) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in PROMPTS]


def test_llama4_image_text_checkpoint_serves_its_language_model(tmp_path):
    """Llama 4 Scout / Maverick ship as Llama4ForConditionalGeneration: the language model
    is served (its vision tower's tensors are not read) and equals transformers' own."""
    import transformers as tf
    from helpers import make_tokenizer

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                attention_chunk_size=8, floor_scale=4, attn_scale=0.5, no_rope_layer_interval=2,
                pad_token_id=0, eos_token_id=1, bos_token_id=0, initializer_range=0.2)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5)
    torch.manual_seed(0)
    model = tf.Llama4ForConditionalGeneration(tf.Llama4Config(
        text_config=text, vision_config=vision, image_token_index=500)).eval()
    model.save_pretrained(tmp_path)
    make_tokenizer(str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(tmp_path), kv_cache_memory_gib=0.01) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model.language_model, p, 10)
                                                      for p in PROMPTS]
