"""GGUF files of the architectures beyond Llama/Qwen, written as llama.cpp's converter writes
them (Gemma's 1 + w norms, Phi-3's fused tensors and LongRoPE factor tensors, DeepSeek's MLA
keys and kv_b split in two halves, Granite's permuted q/k and scale keys, Granite-MoE's
stacked experts split, GLM's rotary dimension count, LayerNorm biases): the config read back
is transformers', and the tokens are transformers' in float; blocks kept quantized give the
tokens of the same file expanded."""

import pytest
import torch
from helpers import hf_greedy, make_model

from tokenmill import LLM, SamplingParams, csrc
from tokenmill.convert.gguf_writer import write_gguf
from tokenmill.loading import gguf as gguf_loader

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]
# tiny model -> llama.cpp architecture
GGUF_ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
             "phi3_longrope": "phi3", "phi3_partial": "phi3", "deepseek_v3": "deepseek2",
             "deepseek_v2": "deepseek2",
             "deepseek_v3_yarn": "deepseek2", "gemma": "gemma", "phi": "phi2",
             "starcoder2": "starcoder2", "olmo2": "olmo2", "granite": "granite",
             "granitemoe": "granitemoe", "granitemoeshared": "granitemoe", "glm4": "glm4",
             "glm4_moe": "glm4moe", "gpt_oss": "gpt-oss", "llama4_gguf": "llama4",
             "mamba2": "mamba2", "qwen3_next": "qwen3next"}
# config fields that must come back as transformers has them
FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
          "vocab_size", "tie_word_embeddings"]
ARCH_FIELDS = {
    "gemma2": ["sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
               "query_pre_attn_scalar", "layer_types", "num_key_value_heads", "head_dim"],
    "gemma3": ["sliding_window", "query_pre_attn_scalar", "layer_types", "rope_parameters",
               "num_key_value_heads", "head_dim"],
    "phi3": ["original_max_position_embeddings", "num_key_value_heads", "sliding_window"],
    "gemma": ["num_key_value_heads", "head_dim", "hidden_act"],
    "phi2": ["num_key_value_heads", "layer_norm_eps", "hidden_act"],
    "starcoder2": ["num_key_value_heads", "norm_epsilon", "use_bias", "sliding_window"],
    "olmo2": ["num_key_value_heads", "rms_norm_eps"],
    "granite": ["attention_multiplier", "embedding_multiplier", "residual_multiplier",
                "logits_scaling"],
    "granitemoe": ["attention_multiplier", "embedding_multiplier", "residual_multiplier",
                   "logits_scaling", "num_local_experts", "num_experts_per_tok"],
    "glm4": ["num_key_value_heads", "head_dim", "attention_bias"],
    "glm4moe": ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor",
                "norm_topk_prob", "use_qk_norm", "attention_bias", "head_dim"],
    "llama4": ["intermediate_size_mlp", "num_local_experts", "num_experts_per_tok",
               "interleave_moe_layer_step", "moe_layers", "no_rope_layers", "use_qk_norm",
               "attention_chunk_size", "head_dim"],
    "gpt-oss": ["num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                "head_dim", "attention_bias", "rope_parameters"],
    "qwen3next": ["linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_value_head_dim", "layer_types",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                  "num_key_value_heads", "head_dim", "rms_norm_eps"],
    "deepseek2": ["kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                  "v_head_dim", "first_k_dense_replace", "n_routed_experts",
                  "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor",
                  "norm_topk_prob", "moe_intermediate_size", "n_group", "topk_group"],
}


def _write(tmp_path, tiny_models, arch, qtype=None):
    from gguf import GGMLQuantizationType

    if arch == "deepseek_v3_yarn":
        # GGUF keeps only mscale_all_dim (llama.cpp takes mscale equal to it, as DeepSeek's
        # own configs have them)
        hf_path = str(tmp_path / "hf")
        rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0,
                "original_max_position_embeddings": 64}
        hf = make_model(hf_path, arch, rope_parameters=rope)
    elif arch == "starcoder2":  # llama.cpp keeps no window: a model without one
        hf_path = str(tmp_path / "hf")
        hf = make_model(hf_path, arch, sliding_window=None)
    else:
        hf_path, hf = tiny_models(arch)
    state = {k: v for k, v in hf.state_dict().items()
             if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    path = str(tmp_path / f"{arch}.gguf")
    kind = None if qtype is None else GGMLQuantizationType[qtype]
    write_gguf(path, GGUF_ARCH[arch], state, hf.config,
               lambda name: kind if name.endswith(("proj.weight", "_exps.weight", "attn_q.weight",
                                                   "attn_k.weight", "attn_v.weight",
                                                   "attn_output.weight", "attn_qkv.weight",
                                                   "ffn_up.weight", "ffn_gate.weight",
                                                   "ffn_down.weight", "attn_q_b.weight",
                                                   "token_embd.weight", "ssm_in.weight",
                                                   "ssm_out.weight", "ssm_ba.weight"))
               else None)
    gguf_loader._reader.cache_clear()
    return path, hf_path, hf


def _generate(path, hf_path, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    gguf_loader._reader.cache_clear()
    with LLM(path, tokenizer=hf_path, kv_cache_memory_gib=0.01, **kwargs) as llm:
        model = llm.engine.core.runner.model
        kernels = {m.kernel.name for m in model.modules() if hasattr(m, "kernel")}
        if model.model.embed_tokens.weight is None:  # lookups in the tied head's blocks
            kernels.add("embedding: " + model.lm_head.kernel.name)
        return kernels, [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_float_files_give_transformers_config_and_tokens(tmp_path, tiny_models, arch):
    path, hf_path, hf = _write(tmp_path, tiny_models, arch)
    config = gguf_loader.load_gguf_config(path)
    assert config.architectures == [type(hf).__name__]
    if arch == "mamba2":  # (no attention: its own sizes)
        for key in ("hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings",
                    "expand", "num_heads", "head_dim", "state_size", "n_groups",
                    "conv_kernel", "use_conv_bias", "use_bias", "layer_norm_epsilon"):
            assert getattr(config, key) == getattr(hf.config, key), key
        assert _generate(path, hf_path)[1] == [hf_greedy(hf, p, 10) for p in PROMPTS]
        return
    for key in FIELDS + ARCH_FIELDS[GGUF_ARCH[arch]]:
        assert getattr(config, key) == getattr(hf.config, key), key
    # (llama.cpp keeps the number of dimensions that rotate)
    dims = [int(c.rope_parameters.get("partial_rotary_factor", 1.0)
                * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads))
            for c in (config, hf.config)]
    assert dims[0] == dims[1]
    if arch == "phi3_longrope":
        ours, theirs = config.rope_parameters, hf.config.rope_parameters
        assert ours["rope_type"] == "longrope"
        for key in ("long_factor", "short_factor"):  # (stored as float32)
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6), key
    if arch == "deepseek_v3_yarn":
        ours, theirs = config.rope_parameters, hf.config.rope_parameters
        for key in ("rope_type", "factor", "original_max_position_embeddings", "mscale_all_dim"):
            assert ours[key] == pytest.approx(theirs[key]), key
    _, tokens = _generate(path, hf_path)
    assert tokens == [hf_greedy(hf, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("arch,qtype", [("gemma2", "Q8_0"), ("phi3", "Q4_1"),
                                        ("deepseek_v3", "Q8_0"), ("gemma3", "Q5_0"),
                                        ("gemma2", "Q5_1"), ("gemma", "Q8_0"), ("phi", "Q8_0"),
                                        ("starcoder2", "Q5_0"), ("granitemoe", "Q8_0"),
                                        ("glm4", "Q4_1"), ("glm4_moe", "Q8_0"),
                                        ("gpt_oss", "MXFP4"), ("llama4_gguf", "Q8_0"),
                                        ("mamba2", "Q8_0"), ("qwen3_next", "Q8_0")])
def test_blocks_kept_quantized_give_the_expanded_files_tokens(tmp_path, tiny_models,
                                                              monkeypatch, arch, qtype):
    if not csrc.available():
        pytest.skip("no compiled CPU kernels: blocks are expanded")
    path, hf_path, _ = _write(tmp_path, tiny_models, arch, qtype)
    kernels, tokens = _generate(path, hf_path)
    # (Q5: as stored; MXFP4: 4-bit codes on VNNI CPUs, the int8 kernel elsewhere)
    kind = {"Q8_0": "int8", "Q4_1": "int4", "MXFP4": ("mxfp4", "int8")}.get(qtype,
                                                                         qtype.lower())
    assert any(k.startswith(kind) for k in kernels), kernels
    if arch.startswith("gemma"):  # tied: no float copy of the table beside the head's blocks
        assert any(k.startswith(f"embedding: {kind}") for k in kernels), kernels
    monkeypatch.setattr(csrc, "available", lambda: False)  # every block expanded to float
    assert _generate(path, hf_path)[1] == tokens


def test_deepseek_files_before_llamacpps_mla_keep_kv_b_whole(tmp_path, tiny_models):
    """Older deepseek2 files: one attn_kv_b tensor and per-head key/value lengths."""
    import gguf
    from gguf import GGUFReader, GGUFWriter

    path, hf_path, hf = _write(tmp_path, tiny_models, "deepseek_v2")
    old = str(tmp_path / "old.gguf")
    reader = GGUFReader(path)
    writer = GGUFWriter(old, "deepseek2")
    config = hf.config
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        name = field.name.split(".", 1)[1] if field.name.startswith("deepseek2.") else None
        if name in ("attention.key_length_mla", "attention.value_length_mla"):
            continue
        if name == "attention.key_length":
            writer.add_key_length(config.qk_nope_head_dim + config.qk_rope_head_dim)
        elif name == "attention.value_length":
            writer.add_value_length(config.v_head_dim)
        elif name == "attention.head_count_kv":
            writer.add_head_count_kv(config.num_attention_heads)
        else:
            value = field.contents()
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(field.name, value)
            else:
                writer.add_key_value(field.name, value, kind)
    halves = {}
    for tensor in reader.tensors:
        data = torch.from_numpy(tensor.data.copy()).float().numpy()
        if tensor.name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            halves[tensor.name] = data
            layer = tensor.name.split(".")[1]
            k_b, v_b = (halves.get(f"blk.{layer}.attn_{h}_b.weight") for h in "kv")
            if k_b is not None and v_b is not None:
                kv_b = gguf_loader.gguf_archs.join_kv_b(k_b, v_b, config.num_attention_heads,
                                                         config.kv_lora_rank)
                writer.add_tensor(f"blk.{layer}.attn_kv_b.weight", kv_b)
            continue
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, tokens = _generate(old, hf_path)
    assert tokens == [hf_greedy(hf, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("arch,qtype", [("phi3", "Q4_1"), ("phi3", "Q5_1"), ("glm4", "Q4_1"),
                                        ("granitemoe", "Q8_0")])
def test_fused_blocks_split_over_two_ranks(tmp_path, tiny_models, arch, qtype):
    """Phi-3's one q|k|v and one gate|up tensor (GLM-4's gate|up), kept as Q4_1 (int4) or
    Q5_1 (int8 with offsets) blocks: each rank cuts its heads and rows of each projection
    from the fused tensor, and its inputs' groups (with their offsets) of the row-parallel
    ones; Granite-MoE's permuted q / k blocks and stacked experts: one rank's tokens."""
    if not csrc.available():
        pytest.skip("no compiled CPU kernels: blocks are expanded")
    path, hf_path, _ = _write(tmp_path, tiny_models, arch, qtype)
    kernels, one = _generate(path, hf_path)
    two_kernels, two = _generate(path, hf_path, tensor_parallel_size=2)
    assert ("int4" if qtype == "Q4_1" else "int8") in " ".join(two_kernels)
    assert two == one


def test_llamacpp_defaults_for_gemma3_files():
    """Files that store neither: llama.cpp's fixed 5-local-to-1-global pattern, local rope
    base 10000; query_pre_attn_scalar from the model size, as llama.cpp derives it."""
    from tokenmill.loading.gguf_archs import configure

    def get(key, default):
        return default

    for layers, scalar in ((26, 256), (62, 5376 // 32)):
        kwargs = {"num_hidden_layers": layers, "num_attention_heads": 32, "hidden_size": 5376,
                  "head_dim": 256, "max_position_embeddings": 8192}
        kwargs, rope = configure("gemma3", get, set(), kwargs, {"rope_type": "default",
                                                                "rope_theta": 1e6})
        assert kwargs["sliding_window_pattern"] == 6
        assert kwargs["query_pre_attn_scalar"] == scalar
        assert rope == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
