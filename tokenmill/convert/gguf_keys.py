"""Each architecture's metadata keys as llama.cpp's converter (convert_hf_to_gguf.py)
writes them beyond the common ones (gguf_writer.py), and the rope settings they come from:
Llama 3.1's `rope_freqs` (and the scaling parameters recovered from them), Gemma's windows
and soft-capping, Phi-3's LongRoPE tensors, DeepSeek's MLA and routing, Granite's scales,
the rotary dimensions of Phi-2 and GLM, GLM-4.5's routing."""

from __future__ import annotations

import numpy as np


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_settings(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling",
                                                                     None) or {})
    return params.get("full_attention", params)  # (Gemma 3: the global layers')


def llama3_rope_factors(config, rope) -> np.ndarray:
    """llama.cpp's `rope_freqs`: each rotary frequency's divisor under Llama-3 scaling."""
    import math

    dim = head_dim(config)
    theta = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def llama3_rope_from_factors(config, rope: dict) -> dict | None:
    """The Llama-3 scaling parameters that give a file's `rope_freqs` (llama.cpp keeps only
    the factors), searched among the values Llama 3.x models use; None if none fits."""
    want = np.asarray(rope["freq_factors"], dtype=np.float64)
    for old in [2 ** k for k in range(13, 5, -1)] + [2 ** k for k in range(14, 18)]:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (0.5, 4.0)):
            guess = {"rope_type": "llama3", "rope_theta": rope["rope_theta"],
                     "factor": float(want.max()), "low_freq_factor": low,
                     "high_freq_factor": high, "original_max_position_embeddings": old}
            if np.allclose(llama3_rope_factors(config, guess), want, rtol=1e-5, atol=1e-6):
                return guess
    return None


def _llama_keys(writer, config):
    rope = rope_settings(config)
    if rope.get("rope_type") == "llama3":  # as llama.cpp's converter stores Llama 3.1 scaling
        return {"rope_freqs.weight": llama3_rope_factors(config, rope)}
    return {}


def _gemma_keys(writer, config):
    import gguf

    writer.add_sliding_window(config.sliding_window)
    if getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    params = getattr(config, "rope_parameters", None) or {}
    if "sliding_attention" in params:  # Gemma 3
        writer.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
        writer.add_sliding_window_pattern(_window_pattern(config))
        full = params["full_attention"]
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])


def _window_pattern(config):
    """Gemma 3's local/global layout for llama.cpp: the period N (every N-th layer global) as
    older configs state it (`sliding_window_pattern`, today's `_sliding_window_pattern`) when
    `layer_types` follows it, else the per-layer flags (windowed or not) newer files carry."""
    types = getattr(config, "layer_types", None)
    period = getattr(config, "sliding_window_pattern", None) or \
        getattr(config, "_sliding_window_pattern", None)
    if not types:
        if period is None:
            raise ValueError("The Gemma 3 config states neither layer_types nor "
                             "sliding_window_pattern.")
        return int(period)
    local = [kind == "sliding_attention" for kind in types]
    if period and local == [(i + 1) % int(period) != 0 for i in range(len(local))]:
        return int(period)
    return local


def _phi3_keys(writer, config):
    rope = rope_settings(config)
    original = getattr(config, "original_max_position_embeddings", None) or \
        config.max_position_embeddings
    _rotary_dims(writer, config)  # (Phi-4-mini: 75 % of each head)
    writer.add_rope_scaling_orig_ctx_len(original)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "longrope":
        return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
    return {}


def _deepseek2_keys(writer, config):
    """What the MLA-era converter writes: the latent row under key/value_length, one KV
    head, per-head sizes under the _mla keys."""
    import gguf

    rank, rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope_dim)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + rope_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    sigmoid = getattr(config, "topk_method", None) is None  # (V3's config has none)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    if (config.n_group or 1) > 1:
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    writer.add_rope_dimension_count(rope_dim)
    rope = rope_settings(config)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _rotary_dims(writer, config):
    """Phi-2 and GLM: the dimensions of each head that rotate."""
    factor = rope_settings(config).get("partial_rotary_factor",
                               getattr(config, "partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(head_dim(config) * factor))


def _layernorm_keys(writer, config):
    eps = getattr(config, "layer_norm_eps", None) or config.norm_epsilon
    writer.add_layer_norm_eps(eps)
    if hasattr(config, "partial_rotary_factor") or "partial_rotary_factor" in rope_settings(config):
        _rotary_dims(writer, config)


def _granite_keys(writer, config):
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    if getattr(config, "shared_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)


def _glm4moe_keys(writer, config):
    import gguf

    _rotary_dims(writer, config)  # (expert count, used count, size: as every MoE's above)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_nextn_predict_layers(0)  # (MTP layers are not written)
    if (config.n_group or 1) > 1:  # (GLM-4.5's have one group; llama.cpp writes none)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)


def _gpt_oss_keys(writer, config):
    import gguf

    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    rope = rope_settings(config)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _llama4_keys(writer, config):
    writer.add_interleave_moe_layer_step(config.interleave_moe_layer_step)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    return _llama_keys(writer, config)


def _ssm_keys(writer, conv: int, state: int, groups: int, heads: int, inner: int) -> None:
    writer.add_ssm_conv_kernel(conv)
    writer.add_ssm_state_size(state)
    writer.add_ssm_group_count(groups)
    writer.add_ssm_time_step_rank(heads)
    writer.add_ssm_inner_size(inner)


def _mamba2_keys(writer, config):
    """Mamba-2: no attention (llama.cpp's converter writes 0 heads and 0 feed-forward, and
    an arbitrary 2^20 context: there are no positions)."""
    writer.add_context_length(2 ** 20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)
    _ssm_keys(writer, config.conv_kernel, config.state_size, config.n_groups,
              config.num_heads, config.num_heads * config.head_dim)


def _qwen3next_keys(writer, config):
    _ssm_keys(writer, config.linear_conv_kernel_dim, config.linear_key_head_dim,
              config.linear_num_key_heads, config.linear_num_value_heads,
              config.linear_num_value_heads * config.linear_value_head_dim)
    writer.add_full_attention_interval(getattr(config, "full_attention_interval", 4))
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    _rotary_dims(writer, config)


ARCH_KEYS = {"llama": _llama_keys, "gemma2": _gemma_keys, "gemma3": _gemma_keys,
             "phi3": _phi3_keys, "deepseek2": _deepseek2_keys, "phi2": _layernorm_keys,
             "starcoder2": _layernorm_keys, "granite": _granite_keys,
             "granitemoe": _granite_keys, "glm4": _rotary_dims, "glm4moe": _glm4moe_keys,
             "gpt-oss": _gpt_oss_keys, "llama4": _llama4_keys, "mamba2": _mamba2_keys,
             "qwen3next": _qwen3next_keys}
