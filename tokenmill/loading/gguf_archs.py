"""llama.cpp's architectures as GGUF files store them: each one's HF architecture, its
metadata keys as HF config fields, and its tensor names as HF names, with what llama.cpp's
converter changed undone (gguf.py reads the files through these tables)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tokenmill.loading import gguf_state_archs

# GGUF architecture -> (HF architecture, transformers config class name)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"),
    # DeepSeek-V2 / V3 / R1 (the config class picked by the routing's gating function)
    "deepseek2": ("DeepseekV2ForCausalLM", "DeepseekV2Config"),
    "gemma": ("GemmaForCausalLM", "GemmaConfig"),
    "phi2": ("PhiForCausalLM", "PhiConfig"),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config"),
    "granite": ("GraniteForCausalLM", "GraniteConfig"),
    # (Granite-MoE-Shared when the file has shared experts)
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig"),
    "glm4": ("Glm4ForCausalLM", "Glm4Config"),
    "glm4moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig"),
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig"),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig"),
    **gguf_state_archs.ARCHITECTURES,  # (Mamba-2, Qwen3-Next)
}
# llama.cpp stores Q and K rows of these architectures interleaved for its rope kernel.
PERMUTED_QK = {"llama", "mistral", "granite", "granitemoe"}
# llama.cpp's Gemma files store RMSNorm weights as 1 + w (HF stores w).
NORMS_PLUS_ONE = {"gemma", "gemma2", "gemma3"}
# LayerNorm families: their norms' biases, and epsilon under layer_norm_epsilon
_LAYERNORM_NAMES = {"attn_norm.bias": "input_layernorm.bias",
                    "ffn_norm.bias": "post_attention_layernorm.bias",
                    "attn_output.bias": "self_attn.o_proj.bias"}

LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a mixture of experts' router
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_GEMMA_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    # one fused q|k|v and one gate|up tensor, as Phi-3's own checkpoints
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    # Phi-2: separate q / k / v (a fused attn_qkv in files converted from the original
    # format), `dense` output, fc1 / fc2 MLP, all biased
    "phi2": {**_LAYERNORM_NAMES,
             "attn_qkv.weight": "self_attn.qkv_proj.weight",
             "attn_qkv.bias": "self_attn.qkv_proj.bias",
             "attn_output.weight": "self_attn.dense.weight",
             "attn_output.bias": "self_attn.dense.bias",
             "ffn_up.weight": "mlp.fc1.weight", "ffn_up.bias": "mlp.fc1.bias",
             "ffn_down.weight": "mlp.fc2.weight", "ffn_down.bias": "mlp.fc2.bias"},
    "starcoder2": {**_LAYERNORM_NAMES,
                   "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
                   "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias"},
    "olmo2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    # Glm4's post_attention_layernorm is the norm before the MLP; gate|up one tensor
    "glm4": {"post_attention_norm.weight": "post_self_attn_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "post_ffw_norm.weight": "post_mlp_layernorm.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "glm4moe": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
    # (its experts: the common per-expert names; models/llama4.py stacks them for HF)
    "llama4": {"ffn_gate.weight": "feed_forward.gate_proj.weight",
               "ffn_up.weight": "feed_forward.up_proj.weight",
               "ffn_down.weight": "feed_forward.down_proj.weight",
               "ffn_gate_inp.weight": "feed_forward.router.weight",
               "ffn_gate_shexp.weight": "feed_forward.shared_expert.gate_proj.weight",
               "ffn_up_shexp.weight": "feed_forward.shared_expert.up_proj.weight",
               "ffn_down_shexp.weight": "feed_forward.shared_expert.down_proj.weight"},
    "gpt-oss": {"attn_sinks.weight": "self_attn.sinks",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "attn_output.bias": "self_attn.o_proj.bias",
                "ffn_gate_inp.weight": "mlp.router.weight",
                "ffn_gate_inp.bias": "mlp.router.bias"},
    "deepseek2": {
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # (files before llama.cpp's MLA)
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    },
}
# Every expert's weights in one [experts, rows, columns] tensor: one HF tensor per expert.
EXPERT_NAMES = {
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
    # (gpt-oss' experts have biases: [experts, rows])
    "ffn_gate_exps.bias": "mlp.experts.{}.gate_proj.bias",
    "ffn_up_exps.bias": "mlp.experts.{}.up_proj.bias",
    "ffn_down_exps.bias": "mlp.experts.{}.down_proj.bias",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ARCH_GLOBAL_NAMES = {
    "phi2": {"output_norm.weight": "model.final_layernorm.weight",
             "output_norm.bias": "model.final_layernorm.bias", "output.bias": "lm_head.bias"},
    "starcoder2": {"output_norm.bias": "model.norm.bias"},
}
# DeepSeek's kv_b_proj as llama.cpp's MLA files split it: K half [heads, rank, nope] (each
# head transposed), V half [heads, v, rank]; put back together by `join_kv_b`.
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")


def decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not
    9.99999974e-06): the value the checkpoint's config had."""
    return float(str(np.float32(value)))


def layer_names(arch: str) -> dict[str, str]:
    return {**LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {}),
            **gguf_state_archs.LAYER_NAMES.get(arch, {})}


def global_names(arch: str) -> dict[str, str]:
    return {**GLOBAL_NAMES, **_ARCH_GLOBAL_NAMES.get(arch, {}),
            **gguf_state_archs.GLOBAL_NAMES.get(arch, {})}


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray, heads: int, rank: int) -> np.ndarray:
    """kv_b_proj [heads * (nope + v), rank] from llama.cpp's attn_k_b / attn_v_b."""
    k = k_b.reshape(heads, rank, -1).transpose(0, 2, 1)
    v = v_b.reshape(heads, -1, rank)
    return np.concatenate([k, v], axis=1).reshape(-1, rank)


def configure(arch: str, get: Callable[[str, Any], Any], tensor_names: set[str],
              kwargs: dict[str, Any], rope: dict[str, Any]) -> tuple[dict, dict]:
    """The architecture's own config fields (added to `kwargs`) and rope settings (`rope`,
    or per layer type for Gemma 3). `get(key, default)` reads `{arch}.{key}`."""
    if arch == "mistral":  # (transformers' MistralConfig would assume a 4096-token window)
        window = get("attention.sliding_window", None)
        kwargs["sliding_window"] = None if window is None else int(window)
    elif arch in ("gemma2", "gemma3"):
        return _gemma(arch, get, kwargs, rope)
    elif arch == "phi3":
        window = get("attention.sliding_window", None)
        kwargs["sliding_window"] = int(window) if window else None
        kwargs["original_max_position_embeddings"] = int(
            get("rope.scaling.original_context_length", kwargs["max_position_embeddings"]))
    elif arch == "deepseek2":
        kwargs.update(_deepseek2(get, kwargs))
        if rope.get("rope_type") == "yarn":
            mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
            rope.update(beta_fast=32.0, beta_slow=1.0, mscale=mscale, mscale_all_dim=mscale)
    elif arch in _FAMILIES:
        _FAMILIES[arch](get, tensor_names, kwargs, rope)
    if arch in ("phi2", "phi3", "glm4", "glm4moe"):  # rotary on rope.dimension_count
        rotated = get("rope.dimension_count", None)
        if rotated is not None:
            rope["partial_rotary_factor"] = int(rotated) / kwargs["head_dim"]
    kwargs.update(_moe_config(arch, get, tensor_names, kwargs["num_hidden_layers"]))
    return kwargs, rope


def _layernorm(get, tensor_names: set[str], kwargs: dict, rope: dict) -> None:
    """Phi-2 and Starcoder2: LayerNorms (their epsilon under layer_norm_epsilon), biases
    everywhere, GELU; llama.cpp keeps no sliding window for Starcoder2 (it attends to the
    whole context, and so does this file's config)."""
    eps = decimal(get("attention.layer_norm_epsilon", 1e-5))
    del kwargs["rms_norm_eps"]
    if kwargs["architectures"] == ["PhiForCausalLM"]:
        kwargs.update(layer_norm_eps=eps, hidden_act="gelu_new", qk_layernorm=False)
    else:
        kwargs.update(norm_epsilon=eps, hidden_act="gelu_pytorch_tanh", sliding_window=None,
                      use_bias="blk.0.attn_q.bias" in tensor_names)


def _granite(get, tensor_names: set[str], kwargs: dict, rope: dict) -> None:
    """Granite's multipliers (llama.cpp's *_scale keys); Granite-MoE's experts, each the
    file's feed_forward_length wide, and its shared expert when the file has one."""
    kwargs.update(attention_multiplier=decimal(get("attention.scale", 1.0)),
                  embedding_multiplier=decimal(get("embedding_scale", 1.0)),
                  residual_multiplier=decimal(get("residual_scale", 1.0)),
                  logits_scaling=decimal(get("logit_scale", 1.0)))
    kwargs.pop("head_dim")  # (Granite's configs have none: llama.cpp ignores it)
    experts = get("expert_count", None)
    if not experts:
        return
    kwargs.update(num_local_experts=int(experts),
                  num_experts_per_tok=int(get("expert_used_count", 0)))
    shared = get("expert_shared_feed_forward_length", None)
    if shared:
        kwargs.update(shared_intermediate_size=int(shared),
                      architectures=["GraniteMoeSharedForCausalLM"],
                      _config_class="GraniteMoeSharedConfig")


def _glm4(get, tensor_names: set[str], kwargs: dict, rope: dict) -> None:
    """GLM-4: q|k|v biases when the file has them. GLM-4.5: DeepSeek's routing keys (one
    group: llama.cpp's converter writes none), q/k norms when present; its MTP layers
    (blocks past the decoder's) are not read from GGUF files."""
    kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if get("expert_count", None) is None:
        return
    kwargs.update(
        n_routed_experts=int(get("expert_count", 0)),
        num_experts_per_tok=int(get("expert_used_count", 0)),
        moe_intermediate_size=int(get("expert_feed_forward_length", 0)),
        n_shared_experts=int(get("expert_shared_count", 0)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        routed_scaling_factor=decimal(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        n_group=int(get("expert_group_count", 1) or 1),
        topk_group=int(get("expert_group_used_count", 1) or 1),
        use_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        num_nextn_predict_layers=0)


def _gpt_oss(get, tensor_names: set[str], kwargs: dict, rope: dict) -> None:
    """gpt-oss: experts as wide as feed_forward_length, its window, biases everywhere; its
    YaRN without truncating the ramp's ends (as its HF config: the GGUF keeps no flag)."""
    kwargs.update(num_local_experts=int(get("expert_count", 0)),
                  num_experts_per_tok=int(get("expert_used_count", 0)),
                  sliding_window=int(get("attention.sliding_window", 128)),
                  attention_bias=True)
    if rope.get("rope_type") == "yarn":
        rope.update(beta_fast=32.0, beta_slow=1.0, truncate=False)


def _llama4(get, tensor_names: set[str], kwargs: dict, rope: dict) -> None:
    """Llama 4: dense layers feed_forward_length wide, experts expert_feed_forward_length;
    what llama.cpp fixes rather than stores (no rotary every 4th layer, 8192-token chunks,
    the temperature tuning's constants) is transformers' default too; q/k norms on except
    for Maverick's 128 experts, as llama.cpp decides."""
    experts = int(get("expert_count", 0))
    kwargs.update(intermediate_size_mlp=kwargs["intermediate_size"],
                  intermediate_size=int(get("expert_feed_forward_length", 0)),
                  num_local_experts=experts,
                  num_experts_per_tok=int(get("expert_used_count", 1)),
                  interleave_moe_layer_step=int(get("interleave_moe_layer_step", 1)),
                  use_qk_norm=experts != 128)


_FAMILIES = {"phi2": _layernorm, "starcoder2": _layernorm, "granite": _granite,
             "granitemoe": _granite, "glm4": _glm4, "glm4moe": _glm4, "gpt-oss": _gpt_oss,
             "llama4": _llama4,
             "qwen3next": lambda get, names, kwargs, rope: gguf_state_archs.qwen3next_config(
                 get, kwargs, rope),
             "gemma": lambda get, names, kwargs, rope: kwargs.update(
                 hidden_act="gelu_pytorch_tanh")}


def _gemma(arch: str, get, kwargs: dict, rope: dict) -> tuple[dict, dict]:
    """llama.cpp keeps no query_pre_attn_scalar: it takes hidden / heads for the 27B models
    (46 layers for Gemma 2, 62 for Gemma 3) and the head size otherwise, as HF's configs."""
    layers, heads = kwargs["num_hidden_layers"], kwargs["num_attention_heads"]
    big = layers == (46 if arch == "gemma2" else 62)
    kwargs["query_pre_attn_scalar"] = (kwargs["hidden_size"] // heads if big
                                       else kwargs["head_dim"])
    kwargs["sliding_window"] = int(get("attention.sliding_window", 4096))
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    kwargs["tie_word_embeddings"] = True
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = get(key, None)
            kwargs[key] = None if value is None else float(value)
        return kwargs, rope
    # Gemma 3: 5 local layers (rope base 10000, llama.cpp's fixed choice) to 1 global
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: per layer, whether it is windowed
        kwargs["layer_types"] = ["sliding_attention" if local else "full_attention"
                                 for local in pattern]
    else:
        kwargs["sliding_window_pattern"] = int(pattern)
    local = {"rope_type": "default",
             "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
    return kwargs, {"full_attention": rope, "sliding_attention": local}


def _deepseek2(get, kwargs: dict) -> dict:
    """DeepSeek's MLA and routing from llama.cpp's keys. MLA files (key_length_mla present)
    describe the cache's latent row under key_length / value_length and one KV head; older
    ones the per-head sizes."""
    rope_dim = int(get("rope.dimension_count", 64))
    key = int(get("attention.key_length_mla", get("attention.key_length", 192)))
    value = int(get("attention.value_length_mla", get("attention.value_length", 128)))
    q_rank = get("attention.q_lora_rank", None)
    sigmoid = int(get("expert_gating_func", 1)) == 2  # llama.cpp: 1 softmax, 2 sigmoid
    groups, used = int(get("expert_group_count", 1) or 1), int(get("expert_group_used_count", 1)
                                                                  or 1)
    out = dict(
        num_key_value_heads=kwargs["num_attention_heads"], head_dim=rope_dim,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=key - rope_dim, v_head_dim=value,
        kv_lora_rank=int(get("attention.kv_lora_rank", 512)),
        q_lora_rank=None if q_rank is None else int(q_rank),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        moe_intermediate_size=int(get("expert_feed_forward_length", 0)),
        n_routed_experts=int(get("expert_count", 0)),
        num_experts_per_tok=int(get("expert_used_count", 0)),
        n_shared_experts=int(get("expert_shared_count", 0)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        n_group=groups, topk_group=used, moe_layer_freq=1, rope_interleave=True)
    if sigmoid:  # DeepSeek-V3 / R1
        out["architectures"] = ["DeepseekV3ForCausalLM"]
        out["_config_class"] = "DeepseekV3Config"
    else:
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return out


def _moe_config(arch: str, get, tensor_names: set[str], layers: int) -> dict:
    """Mixtures of experts from llama.cpp's keys: Mixtral (a `llama` file with experts), or
    Qwen's, whose layers without a router are dense (`mlp_only_layers`)."""
    experts = get("expert_count", None)
    if not experts or arch not in ("llama", "qwen2moe", "qwen3moe"):
        return {}
    if arch == "llama":  # (llama.cpp writes Mixtral as `llama` with experts)
        return {"architectures": ["MixtralForCausalLM"], "_config_class": "MixtralConfig",
                "num_local_experts": int(experts),
                "num_experts_per_tok": int(get("expert_used_count", 2)),
                "sliding_window": None}
    shared = get("expert_shared_feed_forward_length", None)
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(get("expert_used_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
        "shared_expert_intermediate_size": int(shared or 0),
        # llama.cpp normalizes Qwen3-MoE's top-k weights, not Qwen2-MoE's
        "norm_topk_prob": bool(get("expert_weights_norm", arch == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers)
                            if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    }


def longrope(reader_tensor: Callable[[str], np.ndarray | None], rope: dict) -> dict:
    """Phi-3's LongRoPE factors, stored by llama.cpp as two global tensors."""
    long, short = reader_tensor("rope_factors_long.weight"), reader_tensor(
        "rope_factors_short.weight")
    if long is None or short is None:
        return rope
    return {**rope, "rope_type": "longrope", "long_factor": [float(x) for x in long],
            "short_factor": [float(x) for x in short]}

