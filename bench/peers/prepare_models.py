"""Model files every engine of `bench/compare.py` can load, with the same weights:

- `default`: SmolLM2-135M-Instruct from the bundled Q4_1 GGUF, dequantized once: an fp32 HF
  folder (transformers, vLLM; tokenmill loads it too) and an f32 GGUF (llama.cpp), both holding
  exactly the dequantized values tokenmill computes with.
- `qwen0.5b`: random weights shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads / 2 KV
  heads, vocab 151936, tied embeddings), as an HF folder and an f32 GGUF written from it.
- For the equal-bits comparison (`compare.py --precisions`), each model also as `q8_0.gguf`
  (every matrix Q8_0) and `q4_1.gguf` (linear layers Q4_1, token embedding / tied LM head
  Q8_0, as the bundled default model is: for `default` that file is the bundled one); the
  Qwen shape also as `q4_k_m.gguf`, written by llama.cpp's quantizer. tokenmill and llama.cpp
  load the same file.

- `qwen3moe` (only with `--only qwen3moe`): random weights shaped like a small Qwen3-MoE
  (0.97 B parameters, 0.29 B active), as an HF folder, an f32 GGUF, `q8_0.gguf` and a
  `q4_k_m.gguf` written by llama.cpp's own quantizer (Q4_K with Q6_K for some tensors, as the
  hub's Q4_K_M downloads).

  python bench/peers/prepare_models.py [--out DIR] [--only M]   (default
  $TOKENMILL_PEERS_DIR/models)"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def rewrite_gguf(src: str, dst: str, weight_type: str) -> None:
    """Same metadata and tensors as `src`, every matrix stored as `weight_type` ("F32", "BF16",
    "Q8_0" or "Q4_1"; the token embedding is Q8_0 unless F32 / BF16), vectors F32. llama.cpp's
    Q/K row order is kept."""
    import gguf

    types = gguf.GGMLQuantizationType
    file_types = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                  "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                  "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "general.file_type":
            value = int(file_types[weight_type])
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape)])
        target = types.F32 if data.ndim < 2 or weight_type == "F32" else (
            types.Q8_0 if t.name == "token_embd.weight" and weight_type != "BF16"
            else types[weight_type])
        if target == types.F32:
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_from_gguf(src: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(src), os.path.basename(src)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers will not save a model it loaded from GGUF; copy it into a plain one.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def qwen_shaped(out: str) -> None:
    """Random Qwen2.5-0.5B-shaped weights + a word-level tokenizer of the full vocabulary
    (prompts are token ids; the tokenizer only has to exist and cover the ids)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                         eos_token_id=151645, torch_dtype="float32")
    return _random_model(Qwen2ForCausalLM, config, out)


def _random_model(cls, config, out: str):
    """Random weights of `config` saved in `out` with a word-level tokenizer of the full
    vocabulary (prompts are token ids; the tokenizer only has to exist and cover the ids)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    bos, eos = f"t{config.bos_token_id}", f"t{config.eos_token_id}"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=eos, bos_token=bos,
                            pad_token=bos).save_pretrained(out)
    return model


def _gguf_writer(model, dst: str, arch: str, name: str):
    """A GGUF writer with the keys every model here shares, the dummy vocabulary, and the
    embedding and final norm; the caller adds the rest and `_finish`es it."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(dst, arch)
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    rope = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    w.add_rope_freq_base(rope)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    _dummy_vocab(w, c)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    return w, sd


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_from_qwen(model, dst: str) -> None:
    """llama.cpp's qwen2 layout for the random model (a dummy 'gpt2' vocabulary of the right
    size: llama.cpp only needs token ids here)."""
    c = model.config
    w, sd = _gguf_writer(model, dst, "qwen2", "qwen2.5-0.5b-shaped-random")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
            if p + hf + ".bias" in sd:
                w.add_tensor(f"blk.{i}.{gg}.bias", sd[p + hf + ".bias"])
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    _finish(w)


def qwen3moe_shaped(out: str):
    """Random weights shaped like a small Qwen3-MoE (hidden 1024, 12 layers, 8 heads / 2 KV
    heads of 128, 32 experts of 768 with 8 active, q/k norms, vocabulary 32000 tied): 0.97 B
    parameters, 0.29 B of them read per token (the active experts, attention, the head)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                            moe_intermediate_size=768, num_experts=32, num_experts_per_tok=8,
                            norm_topk_prob=True, num_hidden_layers=12, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=128, max_position_embeddings=32768,
                            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                            bos_token_id=1, eos_token_id=2, decoder_sparse_step=1,
                            mlp_only_layers=[], torch_dtype="float32")
    return _random_model(Qwen3MoeForCausalLM, config, out)


def gguf_from_qwen3moe(model, dst: str) -> None:
    """llama.cpp's qwen3moe layout: each layer's experts stacked in one tensor per
    projection."""
    c = model.config
    w, sd = _gguf_writer(model, dst, "qwen3moe", "qwen3moe-1b-shaped-random")
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    names = {"self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
             "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
             "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
             "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
             "mlp.gate.weight": "ffn_gate_inp"}
    inter = c.moe_intermediate_size
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf])
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [experts, 2 I, H]: gate rows first
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
    _finish(w)


def _dummy_vocab(w, c) -> None:
    """A 'gpt2' vocabulary of the right size (llama.cpp only needs token ids here; it
    refuses a BPE vocabulary without merges, so one harmless merge)."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)


def llamacpp_quantize(src: str, dst: str, ftype: str) -> None:
    """llama.cpp's own quantizer (llama-cpp-python in the peers venv) for the K-quant files,
    which gguf-py cannot write: e.g. ftype LLAMA_FTYPE_MOSTLY_Q4_K_M."""
    import subprocess

    python = os.path.join(os.environ.get("TOKENMILL_PEERS_DIR", os.path.expanduser(
        "~/.cache/tokenmill-peers")), "llamacpp", "bin", "python")
    code = ("import sys, llama_cpp as lc\n"
            "p = lc.llama_model_quantize_default_params()\n"
            f"p.ftype = lc.{ftype}\np.nthread = 0\n"
            "sys.exit(lc.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
            "p))\n")
    subprocess.run([python, "-c", code, src, dst], check=True)


def main() -> None:
    root = os.environ.get("TOKENMILL_PEERS_DIR", os.path.expanduser("~/.cache/tokenmill-peers"))
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(root, "models"))
    p.add_argument("--only", choices=["default", "qwen0.5b", "qwen3moe"], default=None)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    from tokenmill.loading.gguf import default_model_path

    if args.only in (None, "default"):
        out = os.path.join(args.out, "default")
        os.makedirs(out, exist_ok=True)
        if not os.path.exists(os.path.join(out, "hf", "config.json")):
            hf_from_gguf(default_model_path(), os.path.join(out, "hf"))
        if not os.path.exists(os.path.join(out, "f32.gguf")):
            rewrite_gguf(default_model_path(), os.path.join(out, "f32.gguf"), "F32")
        for name in ("Q8_0", "BF16"):
            if not os.path.exists(os.path.join(out, f"{name.lower()}.gguf")):
                rewrite_gguf(default_model_path(), os.path.join(out, f"{name.lower()}.gguf"),
                             name)
        if not os.path.lexists(os.path.join(out, "q4_1.gguf")):
            os.symlink(default_model_path(), os.path.join(out, "q4_1.gguf"))
    if args.only in (None, "qwen0.5b"):
        out = os.path.join(args.out, "qwen0.5b")
        os.makedirs(out, exist_ok=True)
        if not os.path.exists(os.path.join(out, "f32.gguf")):
            if os.path.exists(os.path.join(out, "hf", "model.safetensors")):
                from transformers import Qwen2ForCausalLM

                model = Qwen2ForCausalLM.from_pretrained(os.path.join(out, "hf"))
            else:
                model = qwen_shaped(os.path.join(out, "hf"))
            gguf_from_qwen(model, os.path.join(out, "f32.gguf"))
        for name in ("Q8_0", "Q4_1", "BF16"):
            dst = os.path.join(out, f"{name.lower()}.gguf")
            if not os.path.exists(dst):
                rewrite_gguf(os.path.join(out, "f32.gguf"), dst, name)
        if not os.path.exists(os.path.join(out, "q4_k_m.gguf")):  # (a dense K-quant file)
            llamacpp_quantize(os.path.join(out, "f32.gguf"), os.path.join(out, "q4_k_m.gguf"),
                              "LLAMA_FTYPE_MOSTLY_Q4_K_M")
    if args.only == "qwen3moe":  # (3.9 GB in fp32: only when asked for)
        out = os.path.join(args.out, "qwen3moe")
        os.makedirs(out, exist_ok=True)
        if not os.path.exists(os.path.join(out, "f32.gguf")):
            model = qwen3moe_shaped(os.path.join(out, "hf"))
            gguf_from_qwen3moe(model, os.path.join(out, "f32.gguf"))
            del model
        if not os.path.exists(os.path.join(out, "q8_0.gguf")):
            rewrite_gguf(os.path.join(out, "f32.gguf"), os.path.join(out, "q8_0.gguf"), "Q8_0")
        if not os.path.exists(os.path.join(out, "q4_k_m.gguf")):
            llamacpp_quantize(os.path.join(out, "f32.gguf"), os.path.join(out, "q4_k_m.gguf"),
                              "LLAMA_FTYPE_MOSTLY_Q4_K_M")
    print(f"models in {args.out}")


if __name__ == "__main__":
    main()
