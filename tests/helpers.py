"""Tiny random-weight checkpoints of each supported architecture, built with transformers."""

from __future__ import annotations

import base64
import io
import json
import os
import random

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata, leading_decodes
from tokenmill.attention.torch_sdpa import TorchSDPABackend

TINY_VOCAB = 512
_TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
         "Tokens flow through the mill, batch after batch, block after block. ") * 20


def make_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(path)
    return fast


def make_spm_tokenizer(path: str):
    """A SentencePiece-style BPE (Llama 2 / Mistral / Gemma's tokenizer.json shape): "▁" for
    spaces and before the text, byte-fallback tokens <0x00>..<0xFF>, BOS added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import LlamaTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([_TEXT], trainers.BpeTrainer(vocab_size=TINY_VOCAB,
                                                         special_tokens=specials))
    fast = LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                              unk_token="<unk>", add_bos_token=True)
    fast.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                          "{% endfor %}")
    fast.save_pretrained(path)
    return fast


# families whose biases and norm weights a test randomizes (zeros and ones hide mistakes)
BIASED = ("gemma", "phi", "starcoder2", "olmo2", "olmo3", "granite",
          "granitemoe", "granitemoeshared", "glm", "glm4", "glm4_moe", "llama4", "gpt_oss",
          "mamba2", "qwen3_next", "granitemoehybrid")


# families with state layers (Mamba-2, Qwen3-Next's gated DeltaNet): no prefix caching
STATE = ("mamba2", "qwen3_next", "granitemoehybrid")


def make_model(path: str, arch: str = "llama", dtype=torch.float32, **overrides):
    """Saves a 2-layer GQA model of `arch` plus a tokenizer into `path`; returns the HF model."""
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, eos_token_id=1, bos_token_id=0,
                  initializer_range=0.2)
    configs = {
        "llama": lambda: tf.LlamaConfig(**common, tie_word_embeddings=False),
        # the same weights with room for requests a test must still find running (HOLD_TOKENS)
        "llama_long": lambda: tf.LlamaConfig(**{**common, "max_position_embeddings": 32768},
                                             tie_word_embeddings=False),
        "llama3": lambda: tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "llama_linear": lambda: tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "linear", "factor": 2.0}),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**common, tie_word_embeddings=False),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        "phi3": lambda: tf.Phi3Config(**common, pad_token_id=0, tie_word_embeddings=False),
        # Phi-4-mini's shape: rotary on the first 75 % of each head, q|k|v fused
        "phi3_partial": lambda: tf.Phi3Config(**common, pad_token_id=0,
                                              tie_word_embeddings=False,
                                              partial_rotary_factor=0.75),
        # LongRoPE: its short factors within the original 256 positions
        "phi3_longrope": lambda: tf.Phi3Config(
            **common, pad_token_id=0, tie_word_embeddings=False,
            original_max_position_embeddings=256, rope_scaling={
                "rope_type": "longrope", "long_factor": [float(i) for i in range(1, 9)],
                "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.6, 3.2]}),
        # MLA (q through a low-rank q_a|q_b), layer 0 dense, layer 1 8 experts in 2 groups
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=32,
            n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
            kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
            first_k_dense_replace=1, tie_word_embeddings=False),
        # DeepSeek-V2(-Lite): one q_proj, softmax routing limited to the best group
        "deepseek_v2": lambda: tf.DeepseekV2Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=32,
            n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=1.5,
            kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
            topk_method="group_limited_greedy", first_k_dense_replace=1,
            tie_word_embeddings=False),
        # DeepSeek-V3's YaRN: factor 4 over an original 64 positions, mscale on both
        "deepseek_v3_yarn": lambda: tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=32,
            n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32, q_lora_rank=None,
            qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
            num_experts_per_tok=2, first_k_dense_replace=1, tie_word_embeddings=False,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                          "mscale": 1.0, "mscale_all_dim": 0.707,
                          "original_max_position_embeddings": 64}),
        # Qwen2.5's long-context YaRN (no mscale keys)
        "qwen2_yarn": lambda: tf.Qwen2Config(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        # local (8-token window) and global layers, soft-capped attention and logits
        "gemma2": lambda: tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16,
                                          sliding_window=8, pad_token_id=0,
                                          attn_logit_softcapping=5.0,
                                          final_logit_softcapping=3.0),
        # 3 layers: local (8-token window, rope base 100), global (linear x2), local
        "gemma3": lambda: tf.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=8, sliding_window_pattern=2, rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0}, pad_token_id=0),
        "mixtral": lambda: tf.MixtralConfig(**common, num_local_experts=4,
                                            num_experts_per_tok=2, sliding_window=None,
                                            tie_word_embeddings=False),
        # layer 0 sparse (4 experts and a gated shared expert), layer 1 a dense MLP
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32,
                                               shared_expert_intermediate_size=64,
                                               mlp_only_layers=[1], tie_word_embeddings=False),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, head_dim=32, num_experts=8,
                                               num_experts_per_tok=2, moe_intermediate_size=64,
                                               norm_topk_prob=True, tie_word_embeddings=False),
        # Gemma 1: (1 + w) norms, sqrt(hidden) embedding scale, GELU-tanh MLP
        "gemma": lambda: tf.GemmaConfig(**common, head_dim=16, pad_token_id=0),
        # Phi-2: parallel attention and MLP, LayerNorms, 40 % rotary, a biased LM head
        "phi": lambda: tf.PhiConfig(**common, partial_rotary_factor=0.4,
                                    tie_word_embeddings=False, pad_token_id=0),
        # sliding window of 8 on every layer, LayerNorms, biased ungated MLP
        "starcoder2": lambda: tf.Starcoder2Config(**common, sliding_window=8,
                                                  tie_word_embeddings=True),
        "olmo2": lambda: tf.Olmo2Config(**common, pad_token_id=0, tie_word_embeddings=False),
        # local (window 8) and global layers, each rope setting its own
        "olmo3": lambda: tf.Olmo3Config(**common, pad_token_id=0, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"],
                                        tie_word_embeddings=False),
        "granite": lambda: tf.GraniteConfig(**common, embedding_multiplier=3.0,
                                            attention_multiplier=0.3, residual_multiplier=0.5,
                                            logits_scaling=2.5, tie_word_embeddings=False),
        "granitemoe": lambda: tf.GraniteMoeConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0,
            attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=2.5,
            tie_word_embeddings=False),
        "granitemoeshared": lambda: tf.GraniteMoeSharedConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
            embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.5,
            logits_scaling=2.5, tie_word_embeddings=False),
        # GLM-4: interleaved rotary on half of each head, q|k|v biases, stored gate|up
        "glm": lambda: tf.GlmConfig(**common, head_dim=16, pad_token_id=0,
                                    tie_word_embeddings=False),
        "glm4": lambda: tf.Glm4Config(**common, head_dim=16, pad_token_id=0,
                                      tie_word_embeddings=False),
        # Llama 4: layers 0 and 2 rotate (interleaved) within 8-token chunks, q/k L2-normed;
        # 1 and 3 no rotary, whole sequence, temperature-tuned queries; 1 and 3 experts
        "llama4": lambda: tf.Llama4TextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=16, intermediate_size_mlp=96,
            num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
            attention_chunk_size=8, floor_scale=4, attn_scale=0.5, no_rope_layer_interval=2,
            pad_token_id=0, tie_word_embeddings=False),
        # Llama 4 with what llama.cpp fixes rather than stores (its GGUF files): chunks of
        # 8192, every 4th layer without rotary, temperature constants of 8192 and 0.1
        "llama4_gguf": lambda: tf.Llama4TextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=16, intermediate_size_mlp=96,
            num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
            pad_token_id=0, tie_word_embeddings=False),
        # gpt-oss: window 8 / full layers, sinks, YaRN x4 over 64 positions, 4 experts
        "gpt_oss": lambda: tf.GptOssConfig(
            **{**common, "intermediate_size": 32, "max_position_embeddings": 256}, head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, pad_token_id=0, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 64}),
        # Mamba-2: 8 heads of 16 in 2 groups, state 16, chunks of 8 (a prompt spans several)
        "mamba2": lambda: tf.Mamba2Config(
            vocab_size=TINY_VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
            n_groups=2, num_hidden_layers=2, chunk_size=8, eos_token_id=1, bos_token_id=0,
            pad_token_id=0, initializer_range=0.2, tie_word_embeddings=False),
        # Qwen3-Next: DeltaNet, DeltaNet, DeltaNet, gated attention; 2 key heads of 16 with
        # 2 value heads each; 4 experts + a gated shared expert; 25 % rotary
        "qwen3_next": lambda: tf.Qwen3NextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, tie_word_embeddings=False, pad_token_id=0),
        # Granite 4 (-H): Mamba-2, attention (no rotary), Mamba-2, Mamba-2; 4 experts beside
        # the shared MLP; multipliers
        "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(
            **{**common, "num_hidden_layers": 4, "intermediate_size": 32},
            layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8,
            mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8,
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
            embedding_multiplier=1.5, attention_multiplier=0.2, residual_multiplier=0.7,
            logits_scaling=2.0, pad_token_id=0, tie_word_embeddings=False),
        # GLM-4.5: layer 0 dense, layer 1 8 experts in 2 groups and a shared expert; q/k norm
        "glm4_moe": lambda: tf.Glm4MoeConfig(
            **common, head_dim=32, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
            num_nextn_predict_layers=0, tie_word_embeddings=False),
    }
    config = configs[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    # (the class transformers maps the config to, as AutoModelForCausalLM does)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if arch.startswith(("deepseek_v3", "glm4_moe")):  # routing biases start at zero
        with torch.no_grad():
            for layer in model.model.layers[config.first_k_dense_replace:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    if arch in ("qwen2", "qwen2_moe"):  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch in BIASED or arch == "llama4_gguf":  # (and norms at one)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if (name.endswith((".bias", "_bias", "sinks"))
                        and "correction" not in name):
                    param.normal_(0, 0.5)
                elif "norm" in name:
                    param.normal_(0.0 if arch in ("gemma", "qwen3_next") else 1.0, 0.2)
    if arch == "qwen3_next":  # decays of about one per token, not transformers' up to 16:
        with torch.no_grad():  # float32's chunked delta rule (theirs and ours) then drifts
            for name, param in model.named_parameters():  # 3e-5 apart in logprobs, not 1e-4
                if name.endswith("A_log"):
                    param.normal_(0, 0.5)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    make_tokenizer(path)
    return model


def build_kernels_without(tmp_path, flags: list[str], *sources: str):
    """tokenmill/csrc's `sources` compiled here with the instruction sets `flags` switch
    off (e.g. -mno-avx512f: what a CPU without them runs), loaded with ctypes; the test is
    skipped where there is no C compiler or no compiled kernels at all."""
    import ctypes
    import shutil
    import subprocess

    import pytest

    from tokenmill import csrc

    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None or not csrc.available():
        pytest.skip("no C compiler or no compiled CPU kernels")
    here = os.path.dirname(csrc.__file__)
    target = str(tmp_path / "kernels_without.so")
    subprocess.run([compiler, "-O2", "-march=native", *flags, "-mavx2", "-mfma", "-mf16c",
                    "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
                    *(os.path.join(here, f) for f in sources), "-o", target], check=True,
                   timeout=120)
    return ctypes.CDLL(target)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def paged_step(seqs, block_size: int, num_blocks: int, rng: random.Random,
               num_decodes: int | None = None):
    """Metadata of one step over (context, new tokens) sequences (default `num_decodes`: the
    leading one-token sequences, as the model runner counts them), their cache blocks drawn
    in random order; prepared by the CPU backend, as the model runner does once per step."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, qsl = [], [], [0]
    for ctx, q in seqs:
        table = [free.pop() for _ in range(-(-(ctx + q) // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx, ctx + q)]
        qsl.append(qsl[-1] + q)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=qsl,
        context_lens=[c for c, _ in seqs],
        seq_lens=torch.tensor([c + q for c, q in seqs]),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=leading_decodes([c for c, _ in seqs], [c + q for c, q in seqs])
        if num_decodes is None else num_decodes,
        block_size=block_size)
    TorchSDPABackend().prepare(meta)
    return meta


def write_calibration(tmp_path) -> str:
    """A small calibration file for `tokenmill quantize --calib-data`."""
    path = tmp_path / "calib.jsonl"
    lines = [{"text": "Tokens flow through the mill, batch after batch. " * 8},
             "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 6]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


def speculation_keeps_outputs(path: str, prompts: list[list[int]], params, spec: dict,
                              engines: list[dict]) -> None:
    """Outputs of `prompts` with speculation `spec`, under each of `engines` (LLM options),
    equal decoding without it (one rank, default cache); drafts were proposed; every block
    is back in the pool; an engine given `num_kv_blocks` preempted."""
    from tokenmill import LLM

    requests = [{"prompt_token_ids": p} for p in prompts]
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        base = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params,
                                                                    use_tqdm=False)]
    for engine in engines:
        with LLM(path, **{"kv_cache_memory_gib": 0.01, **engine},
                 speculative_config=spec) as llm:
            outs = llm.generate(requests, params, use_tqdm=False)
            core = llm.engine.core
            assert [list(o.outputs[0].token_ids) for o in outs] == base, engine
            assert core.scheduler.num_draft_tokens > 0
            assert core.kv_cache.pool.num_free_blocks == core.kv_cache.num_blocks
            if "num_kv_blocks" in engine:
                assert core.scheduler.num_preemptions > 0


def check_drafts_each_step(core, reference, k: int, max_steps: int = 100,
                           prompts=(), params=None, tag: str = "r") -> int:
    """Add `prompts` (with `params`, ids `tag`0, `tag`1, ...), then step the engine core
    until its requests finish; at every step each running request's drafts must be the
    start of `reference(context, k)`. Returns how many were checked."""
    from tokenmill.engine.protocol import EngineCoreRequest

    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}{i}", prompt, params))
    checked = 0
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        core.step()
        for request in core.scheduler.running:
            if request.spec_token_ids:
                context = request.prompt_token_ids + request.output_token_ids
                want = reference(context, k)
                assert request.spec_token_ids == want[:len(request.spec_token_ids)]
                checked += 1
    assert not core.has_unfinished_requests()
    return checked


def accept_by_fiat(argmax: list[int], drafts: list[int]) -> list[int]:
    """A stand-in for greedy verification (rejection.verify_greedy) that accepts 1 or 2 of
    a request's drafts whatever the target says, then the target's token: tests of random
    draft heads, whose drafts the target would all reject, reach accepted rows this way."""
    accepted = min(len(drafts), 1 + sum(drafts) % 2)
    return drafts[:accepted] + [argmax[accepted]]


def record_replays(monkeypatch, graphs: dict, log: list) -> None:
    """Log (name, bucket, rows a sequence) of every replay of each named StepGraphs (run
    eagerly on the CPU, as captured on a GPU)."""
    for name, each in graphs.items():
        replay = each.replay
        monkeypatch.setattr(each, "replay", lambda size, q, variant, name=name, replay=replay:
                            log.append((name, size, q)) or replay(size, q, variant))


def _pooling_tokenizer(path: str):
    """The tiny tokenizer with a pad token and no chat template (sentence-transformers would
    wrap each text in the template as a chat message)."""
    tok = make_tokenizer(path)
    template = os.path.join(path, "chat_template.jinja")
    if os.path.exists(template):
        os.remove(template)
    tok.chat_template = None
    tok.add_special_tokens({"pad_token": "<pad>"})
    tok.save_pretrained(path)
    return tok


def make_embedding_model(path: str, base: str, pooling_mode: str = "lasttoken",
                         dense: int = 0, normalize: bool = True):
    """A sentence-transformers folder at `path` over the tiny llama saved at `base`:
    Transformer, Pooling (`pooling_mode`), a Tanh `Dense` to `dense` values (0: none),
    Normalize. Returns the SentenceTransformer."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    _pooling_tokenizer(base)
    transformer = Transformer(base)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode)]
    if dense:
        torch.manual_seed(1)
        modules.append(Dense(transformer.get_embedding_dimension(), dense,
                             activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu")
    model.save(path)
    return SentenceTransformer(path, device="cpu")


def make_cross_encoder(path: str):
    """A tiny LlamaForSequenceClassification of one label at `path`, as a CrossEncoder."""
    import transformers as tf
    from sentence_transformers import CrossEncoder

    tok = _pooling_tokenizer(path)
    config = tf.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=1024, eos_token_id=1, bos_token_id=0,
                            initializer_range=0.2, num_labels=1,
                            pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    tf.LlamaForSequenceClassification(config).eval().save_pretrained(path)
    return CrossEncoder(path, device="cpu")


PINPOINTS = [[30, 60], [60, 30], [60, 60]]


def make_llava(path: str, image_size: int = 30, patch: int = 6, tiled: bool = False):
    """A tiny LLaVA-1.5 (CLIP tower of 3 layers, MLP projector, the tiny llama) at `path`
    with its processor (CLIP's image processor, `<image>` as a special token); `tiled`:
    LLaVA-NeXT instead (any-resolution tiles of `PINPOINTS`, a newline row). Returns (the
    HF model, the processor)."""
    import transformers as tf

    tok = make_tokenizer(path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == "
        "'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    image_token = tok.convert_tokens_to_ids("<image>")
    text = tf.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024, eos_token_id=1, bos_token_id=0,
                          initializer_range=0.2, tie_word_embeddings=False)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, image_size=image_size,
                                 patch_size=patch, projection_dim=32)
    if tiled:
        config = tf.LlavaNextConfig(vision_config=vision, text_config=text,
                                    image_token_index=image_token, eos_token_id=1,
                                    bos_token_id=0, image_grid_pinpoints=PINPOINTS)
        model_cls = tf.LlavaNextForConditionalGeneration
    else:
        config = tf.LlavaConfig(vision_config=vision, text_config=text,
                                image_token_index=image_token, eos_token_id=1, bos_token_id=0)
        model_cls = tf.LlavaForConditionalGeneration
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # (random init leaves the projector's biases and norms plain)
        for name, param in model.named_parameters():
            if "vision" in name or "projector" in name or "newline" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    sizes = {"size": {"shortest_edge": image_size},
             "crop_size": {"height": image_size, "width": image_size}}
    images = (tf.LlavaNextImageProcessor(image_grid_pinpoints=PINPOINTS, **sizes) if tiled
              else tf.CLIPImageProcessor(**sizes))
    processor = (tf.LlavaNextProcessor if tiled else tf.LlavaProcessor)(
        image_processor=images, tokenizer=tok, patch_size=patch,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>", chat_template=tok.chat_template)
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    return model, processor


def make_qwen_vl(path: str, version: str = "2.5"):
    """A tiny Qwen2-VL (`version` "2") or Qwen2.5-VL (window attention: windows of 2 x 2
    merged rows, block 1 of 3 over the whole image) over a 2-layer Qwen2 with M-RoPE, at
    `path` with its image processor (28 x 28 pixels a row, 4 to 64 rows an image; the
    Qwen2VLProcessor around it wants torchvision, so tests expand the placeholders as it
    does). Returns (the HF model, the image processor, the tokenizer)."""
    import transformers as tf

    tok = make_tokenizer(path)
    marks = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": marks})
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == "
        "'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    start, pad, end, video = tok.convert_tokens_to_ids(marks)
    text = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, eos_token_id=1, bos_token_id=0,
                initializer_range=0.2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                 "rope_theta": 100.0})  # (positions count: fast rotations)
    marks = dict(image_token_id=pad, video_token_id=video, vision_start_token_id=start,
                 vision_end_token_id=end)
    if version == "2":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2)
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **marks)
        model_cls = tf.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48,
                      num_heads=4, window_size=56, fullatt_block_indexes=[1])
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **marks)
        model_cls = tf.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # (random init leaves the tower's biases and norms plain)
        for name, param in model.named_parameters():
            if "visual" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    images = tf.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    images.save_pretrained(path)
    tok.save_pretrained(path)
    return model, images, tok


ONEVISION_PINPOINTS = [[28, 56], [56, 28], [56, 56]]


def make_llava_onevision(path: str):
    """A tiny LLaVA-OneVision (a 3-layer SigLIP tower on 28-pixel tiles of 7-pixel patches,
    read at its last layer; any-resolution tiles of ONEVISION_PINPOINTS shrunk to one tile's
    worth, "anyres_max_1"; a 2-layer Qwen2) at `path` with its image processor and `<image>`
    as a special token. Returns (the HF model, the image processor, the tokenizer)."""
    import transformers as tf

    tok = make_tokenizer(path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    image_token, video_token = tok.convert_tokens_to_ids(["<image>", "<video>"])
    text = tf.Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024, eos_token_id=1, bos_token_id=0,
                          initializer_range=0.2, tie_word_embeddings=False)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, image_size=28, patch_size=7)
    config = tf.LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=image_token,
        video_token_index=video_token, image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_aspect_ratio="anyres_max_1", eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    model = tf.LlavaOnevisionForConditionalGeneration(config).eval()
    with torch.no_grad():  # (random init leaves the tower's biases and norms plain)
        for name, param in model.named_parameters():
            if "vision" in name or "projector" in name or "newline" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    images = tf.LlavaOnevisionImageProcessorPil(image_grid_pinpoints=ONEVISION_PINPOINTS,
                                                size={"height": 28, "width": 28})
    images.save_pretrained(path)
    tok.save_pretrained(path)
    return model, images, tok


def onevision_greedy(model, images, tok, text: str, imgs: list, n: int = 8
                     ) -> tuple[list[int], list[int]]:
    """(the prompt's ids with each `<image>` grown as LlavaOnevisionProcessor counts it: an
    image alone tiled, one of several its whole-image tile and a newline; transformers' `n`
    greedy tokens). The processor itself wants torchvision: its counting is called here."""
    from types import SimpleNamespace

    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor as Processor,
    )

    side = model.config.vision_config.image_size
    counting = SimpleNamespace(image_processor=images, vision_aspect_ratio="anyres_max_1",
                               num_image_tokens=(side // model.config.vision_config.patch_size)
                               ** 2)
    counting._get_unpadded_features = lambda *a: Processor._get_unpadded_features(counting, *a)
    pad = model.config.image_token_index
    ids, kwargs = tok(text)["input_ids"], {}
    if imgs:
        out = images(images=[imgs], return_tensors="pt")
        grown = ids
        ids, k = [], 0
        for t in grown:
            if t != pad:
                ids.append(t)
                continue
            h, w = out["image_sizes"][k].tolist()
            rows = (counting.num_image_tokens + 1 if len(imgs) > 1 else
                    Processor._get_number_of_features(counting, h, w, side, side))
            ids += [pad] * rows
            k += 1
        kwargs = {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"],
                  "batch_num_images": torch.tensor([len(imgs)])}
    return ids, image_text_greedy(model, ids, n, **kwargs)


GEMMA3_IMAGE = "<start_of_image>"


def make_gemma3_vl(path: str):
    """A tiny Gemma 3 image-text checkpoint (a 3-layer SigLIP tower on 28-pixel images in
    7-pixel patches, pooled to 4 rows; a 2-layer Gemma 3 text model, one sliding-window
    layer of 8 and one global, scores scaled by the head size as Gemma 3 4B-12B's and
    llama.cpp's) at `path` with its image processor, and a tokenizer that
    holds newline runs as single tokens as Gemma's does ("\n" to "\n\n\n\n"). Returns
    (the HF model, the image processor, the tokenizer)."""
    import transformers as tf
    from tokenizers import AddedToken

    tok = make_tokenizer(path)
    tok.add_tokens([AddedToken("\n" * n, normalized=False) for n in (4, 3, 2, 1)])
    marks = [GEMMA3_IMAGE, "<end_of_image>", "<image_soft_token>"]
    tok.add_special_tokens({"additional_special_tokens": marks})
    tok.chat_template = (
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == "
        "'image' %}<start_of_image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
        "{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
        "<start_of_turn>model\n{% endif %}")
    boi, eoi, soft = tok.convert_tokens_to_ids(marks)
    text = tf.Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=1024, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], eos_token_id=1, bos_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, image_size=28, patch_size=7, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                             boi_token_index=boi, eoi_token_index=eoi, image_token_index=soft,
                             eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # (random init leaves the tower's biases and norms plain)
        for name, param in model.named_parameters():
            if "vision" in name or "projector" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    images = tf.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    images.save_pretrained(path)
    tok.save_pretrained(path)
    return model, images, tok


def write_gemma3_gguf(folder: str, model, tok) -> tuple[str, str]:
    """A tiny Gemma 3 image-text checkpoint as llama.cpp ships it: its language model as a
    gemma3 GGUF (tokenmill's writer, the tokenizer and chat template in it), and its image
    side as an mmproj file written as llama.cpp's converter writes one (clip.* metadata,
    tensors named by gguf's MMPROJ name map, the projector's norm stored as 1 + w).
    Returns (the language GGUF's path, the mmproj's)."""
    import gguf

    from tokenmill.convert.gguf_writer import write_gguf

    text = model.config.text_config
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.language_model."):
            state["model." + name[len("model.language_model."):]] = tensor
        elif name == "lm_head.weight":
            state[name] = tensor
    language = os.path.join(folder, "tiny-gemma3.gguf")
    write_gguf(language, "gemma3", state, text, tokenizer=tok)
    vision = model.config.vision_config
    mmproj = os.path.join(folder, "mmproj-tiny-gemma3.gguf")
    writer = gguf.GGUFWriter(mmproj, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text.hidden_size)
    writer.add_vision_image_size(vision.image_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(vision.num_hidden_layers)
    writer.add_vision_head_count(vision.num_attention_heads)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    side = vision.image_size // vision.patch_size
    writer.add_vision_projector_scale_factor(side // int(model.config.mm_tokens_per_image ** .5))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            continue
        hf = name.replace("model.vision_tower.", "vision_tower.vision_model.").replace(
            "model.multi_modal_projector.", "multi_modal_projector.").replace(
            "_weight", ".weight")
        mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if mapped is None:  # (the pooling head: not converted)
            continue
        value = tensor.float().numpy()
        if "soft_emb_norm" in hf:
            value = value + 1
        kind = np.float16 if "input_projection" in hf else np.float32
        writer.add_tensor(mapped, value.astype(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return language, mmproj


def gemma3_greedy(model, images, tok, text: str, imgs: list, n: int = 8
                  ) -> tuple[list[int], list[int]]:
    """(the prompt's ids as Gemma3Processor makes them: each `<start_of_image>` replaced in
    the text by "\n\n<start_of_image>", the soft tokens, "<end_of_image>\n\n", then the
    whole text tokenized; transformers' `n` greedy tokens)."""
    rows = "<image_soft_token>" * model.config.mm_tokens_per_image
    ids = tok(text.replace(GEMMA3_IMAGE, f"\n\n{GEMMA3_IMAGE}{rows}<end_of_image>\n\n"))[
        "input_ids"]
    kwargs = ({"pixel_values": images(images=imgs, return_tensors="pt")["pixel_values"]}
              if imgs else {})
    marks = (torch.tensor([ids]) == model.config.image_token_id).long()
    return ids, image_text_greedy(model, ids, n, token_type_ids=marks, **kwargs)


def qwen_vl_expand(model, images, tok, text: str, imgs: list):
    """(prompt ids with each image's placeholder grown to its rows, as Qwen2VLProcessor
    grows it; the model's keyword inputs for those images)."""
    pad = model.config.image_token_id
    ids = tok(text)["input_ids"]
    if not imgs:
        return ids, {}
    out = images(images=imgs, return_tensors="pt")
    grids, grown, k = out["image_grid_thw"], [], 0
    for t in ids:
        if t == pad:
            grown += [pad] * int(grids[k].prod() // 4)
            k += 1
        else:
            grown.append(t)
    return grown, {"pixel_values": out["pixel_values"], "image_grid_thw": grids}


def qwen_vl_greedy(model, images, tok, text: str, imgs: list, n: int = 8
                   ) -> tuple[list[int], list[int]]:
    """(the prompt's ids as the processor expands them, transformers' `n` greedy tokens)."""
    ids, kwargs = qwen_vl_expand(model, images, tok, text, imgs)
    marks = (torch.tensor([ids]) == model.config.image_token_id).int()
    return ids, image_text_greedy(model, ids, n, mm_token_type_ids=marks, **kwargs)


def image_text_greedy(model, ids: list[int], n: int, **inputs) -> list[int]:
    """An image-text transformers model's `n` greedy tokens after prompt `ids` (`inputs`:
    its image inputs), EOS ignored."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **inputs)
    return out[0, len(ids):].tolist()


def random_image(seed: int, width: int, height: int):
    """A PIL image of random RGB pixels (image-text model tests)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def png(img) -> bytes:
    """A PIL image's PNG file."""
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


_NIXL_PROBE = """
import numpy as np, torch
from nixl._api import nixl_agent, nixl_agent_config
agents, tensors = [], []
for name, fill in (("probe-a", 1.0), ("probe-b", 0.0)):
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    tensor = torch.full((1024,), fill)
    agent.register_memory(agent.get_reg_descs([tensor]))
    agents.append(agent), tensors.append(tensor)
a, b = agents
b.add_remote_agent(a.get_agent_metadata())
rows = lambda t: np.array([[t.data_ptr(), 4096, 0]], dtype=np.uint64)
handle = b.initialize_xfer("READ", b.get_xfer_descs(rows(tensors[1]), "DRAM"),
                           a.get_xfer_descs(rows(tensors[0]), "DRAM"), "probe-a", b"x")
b.transfer(handle)
for _ in range(100000):
    a.get_new_notifs()
    state = b.check_xfer_state(handle)
    if state != "PROC":
        break
assert state == "DONE" and bool((tensors[1] == 1.0).all()), state
"""


def require_nixl() -> None:
    """Skips the calling test module unless NIXL imports and moves host memory on this
    machine (a 4 KB READ between two agents, in a child process bounded to 120 s): where
    UCX finds no transport, the KV transfer tests cannot run, which is not their failure."""
    import pytest

    pytest.importorskip("nixl")
    if _nixl_probe_error() is not None:
        pytest.skip(f"NIXL cannot move memory on this machine: {_nixl_probe_error()}",
                    allow_module_level=True)


_probe_result: list = []


def _nixl_probe_error() -> str | None:
    import subprocess
    import sys

    if not _probe_result:
        try:
            done = subprocess.run([sys.executable, "-c", _NIXL_PROBE], capture_output=True,
                                  text=True, timeout=120)
            _probe_result.append(None if done.returncode == 0
                                 else (done.stderr.strip().splitlines() or ["?"])[-1][:300])
        except subprocess.TimeoutExpired:
            _probe_result.append("a 4 KB read did not finish in 120 s")
    return _probe_result[0]
