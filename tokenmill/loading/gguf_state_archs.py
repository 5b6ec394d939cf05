"""llama.cpp's GGUF files of the models with state layers (`mamba2`, `qwen3next`): their
config from llama.cpp's keys, their tensor names, and what llama.cpp's converter changed,
in both directions: A stored as -exp(A_log), the convolution's weight squeezed to
[channels, kernel], Mamba-2's A and D as [heads, 1] and its norm as [groups, size],
dt_bias as `ssm_dt.bias`, Qwen3-Next's in_proj_qkvz (rows grouped by key head) cut into
`attn_qkv` (q, k, v of all heads) and `attn_gate` (z), and its (1 + w) norms stored as
1 + w (not the DeltaNet's own norm)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# GGUF architecture -> (HF architecture, transformers config class name)
ARCHITECTURES = {"mamba2": ("Mamba2ForCausalLM", "Mamba2Config"),
                 "qwen3next": ("Qwen3NextForCausalLM", "Qwen3NextConfig")}
# the HF names of a layer's tensors (Mamba-2's layers are `backbone.layers.N.`)
LAYER_PREFIX = {"mamba2": "backbone.layers.{}.", "qwen3next": "model.layers.{}."}
_SSM = {"ssm_conv1d.weight": "conv1d.weight", "ssm_dt.bias": "dt_bias", "ssm_a": "A_log",
        "ssm_norm.weight": "norm.weight", "ssm_out.weight": "out_proj.weight"}
LAYER_NAMES = {
    "mamba2": {"attn_norm.weight": "norm.weight", "ssm_in.weight": "mixer.in_proj.weight",
               "ssm_in.bias": "mixer.in_proj.bias", "ssm_conv1d.bias": "mixer.conv1d.bias",
               "ssm_d": "mixer.D", "ssm_out.bias": "mixer.out_proj.bias",
               **{k: "mixer." + v for k, v in _SSM.items()}},
    "qwen3next": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                  "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
                  **{k: "linear_attn." + v for k, v in _SSM.items()}},
}
GLOBAL_NAMES = {"mamba2": {"token_embd.weight": "backbone.embeddings.weight",
                           "output_norm.weight": "backbone.norm_f.weight",
                           "output.weight": "lm_head.weight"}}
# Qwen3-Next's in_proj_qkvz, as llama.cpp stores it: two tensors
QKVZ_PARTS = ("attn_qkv.weight", "attn_gate.weight")


def mamba2_config(get: Callable[[str, Any], Any], tensor_names: set[str]) -> dict:
    hidden, inner = int(get("embedding_length", None)), int(get("ssm.inner_size", None))
    heads = int(get("ssm.time_step_rank", None))
    return dict(hidden_size=hidden, num_hidden_layers=int(get("block_count", None)),
                expand=inner // hidden, num_heads=heads, head_dim=inner // heads,
                state_size=int(get("ssm.state_size", None)),
                n_groups=int(get("ssm.group_count", 1)),
                conv_kernel=int(get("ssm.conv_kernel", 4)),
                use_conv_bias="blk.0.ssm_conv1d.bias" in tensor_names,
                use_bias="blk.0.ssm_in.bias" in tensor_names,
                tie_word_embeddings="output.weight" not in tensor_names)


def qwen3next_config(get: Callable[[str, Any], Any], kwargs: dict, rope: dict) -> None:
    """The DeltaNet's sizes from llama.cpp's ssm keys, the layer pattern, the rotary share,
    the experts (top-k weights normalized, as Qwen3-Next's config)."""
    v_heads = int(get("ssm.time_step_rank", None))
    kwargs.update(
        linear_conv_kernel_dim=int(get("ssm.conv_kernel", 4)),
        linear_key_head_dim=int(get("ssm.state_size", None)),
        linear_num_key_heads=int(get("ssm.group_count", None)),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=int(get("ssm.inner_size", None)) // v_heads,
        full_attention_interval=int(get("full_attention_interval", 4)),
        num_experts=int(get("expert_count", 0)),
        num_experts_per_tok=int(get("expert_used_count", 0)),
        moe_intermediate_size=int(get("expert_feed_forward_length", 0)),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)),
        norm_topk_prob=bool(get("expert_weights_norm", True)), decoder_sparse_step=1)
    rotated = get("rope.dimension_count", None)
    if rotated is not None:
        rope["partial_rotary_factor"] = int(rotated) / kwargs["head_dim"]


def plus_one_norm(arch: str, hf_name: str) -> bool:
    """Whether llama.cpp stores this norm as 1 + w (Qwen3-Next's (1 + w) norms)."""
    return (arch == "qwen3next" and hf_name.endswith("norm.weight")
            and not hf_name.endswith("linear_attn.norm.weight"))


def from_gguf(arch: str, hf_name: str, w: np.ndarray) -> np.ndarray:
    """A state layer's tensor as the HF checkpoint holds it (float32, read from GGUF)."""
    if hf_name.endswith(".A_log"):
        return np.log(-w.reshape(-1))
    if hf_name.endswith((".D", ".mixer.norm.weight")):
        return w.reshape(-1)
    if hf_name.endswith("conv1d.weight"):
        return w.reshape(w.shape[0], 1, -1)
    return w - 1.0 if plus_one_norm(arch, hf_name) else w


def to_gguf(arch: str, hf_name: str, w: np.ndarray, config: Any) -> np.ndarray:
    """The reverse of `from_gguf`, as llama.cpp's converter writes it."""
    if hf_name.endswith(".A_log"):
        w = -np.exp(w)
        return w.reshape(-1, 1) if arch == "mamba2" else w
    if hf_name.endswith(".D"):
        return w.reshape(-1, 1)
    if hf_name.endswith(".mixer.norm.weight"):
        return w.reshape(config.n_groups, -1)
    if hf_name.endswith("conv1d.weight"):
        return w.reshape(w.shape[0], -1)
    return w + 1.0 if plus_one_norm(arch, hf_name) else w


def split_qkvz(w: np.ndarray, config: Any) -> tuple[np.ndarray, np.ndarray]:
    """in_proj_qkvz's rows ([q, k, v, z] per key head) -> (q | k | v of all heads, z)."""
    kd, vd = config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // config.linear_num_key_heads
    grouped = w.reshape(config.linear_num_key_heads, 2 * kd + 2 * r * vd, -1)
    q, k, v, z = np.split(grouped, np.cumsum([kd, kd, r * vd]), axis=1)
    flat = [part.reshape(-1, w.shape[1]) for part in (q, k, v)]
    return np.concatenate(flat), z.reshape(-1, w.shape[1])


def join_qkvz(qkv: np.ndarray, z: np.ndarray, config: Any) -> np.ndarray:
    """The reverse of `split_qkvz`."""
    heads, kd = config.linear_num_key_heads, config.linear_key_head_dim
    q, k, v = np.split(qkv, np.cumsum([heads * kd, heads * kd]))
    parts = [part.reshape(heads, -1, qkv.shape[1]) for part in (q, k, v, z)]
    return np.concatenate(parts, axis=1).reshape(-1, qkv.shape[1])
