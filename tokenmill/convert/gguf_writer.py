"""GGUF files as llama.cpp's converter (convert_hf_to_gguf.py) writes them, from a
transformers model's tensors: what `tokenmill convert --to gguf` writes, and the tests'
stand-in for downloaded GGUF files. Q and K rows permuted for llama.cpp's rope, Gemma norms
stored as 1 + w, experts stacked, MLA's kv_b split in two, the metadata keys llama.cpp reads;
the tokenizer (BPE) and chat template in the metadata when given."""

from __future__ import annotations

import re

import numpy as np
import torch

from tokenmill.loading import gguf_archs
from tokenmill.models.moe import mixtral_name


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

LAYER_MAP = {v: k for k, v in gguf_archs.LAYER_NAMES.items()}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to Q/K rows of Llama-type models."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


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


def write_gguf(path, arch, state, config, qtype=None, blocks=None, tokenizer=None,
               outtype=None):
    """A GGUF of `state` as llama.cpp's converter writes it; `qtype` (a gguf
    GGMLQuantizationType, or a function of the GGUF tensor name giving one or None) stores
    2-D weights in that block format (K-quants by kquants.py, the rest by gguf-py), or, with
    `blocks(kind, shape)`, as the blocks it returns (random ones standing in); `outtype` (a
    `tokenmill convert --outtype`) chooses each tensor's type instead, as mixes.py says.
    A row that is no whole number of a type's blocks takes llama.cpp's fallback type, or
    stays float. `tokenizer`: a transformers fast BPE tokenizer to store (vocabulary, merges,
    special ids, chat template)."""
    import gguf

    from tokenmill.convert import mixes

    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer is not None:
        write_tokenizer(writer, tokenizer, config.vocab_size)
    rope = _rope(config)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    if arch != "deepseek2":  # (MLA files describe the latent cache row instead)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config.vocab_size)
    experts = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):  # (Mixtral's: feed_forward_length)
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    extra = _ARCH_KEYS.get(arch, lambda writer, config: {})(writer, config) or {}
    layer_map = {v: k for k, v in gguf_archs.layer_names(arch).items()}
    items = [*_tensors(arch, state, config, layer_map), *extra.items()]
    if outtype is not None:
        qtype = mixes.plan(outtype, [n for n, w in items if w.ndim >= 2],
                           getattr(config, "num_local_experts", None)
                           or getattr(config, "num_experts", None)
                           or getattr(config, "n_routed_experts", None) or 0).get
        if mixes.file_type(outtype) is not None:
            writer.add_file_type(mixes.file_type(outtype))
    for gname, w in items:
        kind = qtype(gname) if callable(qtype) else qtype
        kind = mixes.fitting(kind, w.shape[-1]) if w.ndim >= 2 else None
        if kind is not None:
            raw = (_encode(np.ascontiguousarray(w), kind) if blocks is None
                   else blocks(kind, w.shape))
            writer.add_tensor(gname, raw, raw_dtype=kind)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _encode(w: np.ndarray, kind) -> np.ndarray:
    """`w` in block type `kind`: K-quants by kquants.py, the rest by gguf-py."""
    from gguf.quants import quantize

    from tokenmill.convert.kquants import QUANTIZERS

    if kind.name in QUANTIZERS:
        return QUANTIZERS[kind.name](w.reshape(-1, w.shape[-1])).reshape(*w.shape[:-1], -1)
    return quantize(w, kind)


def _rope(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling",
                                                                     None) or {})
    return params.get("full_attention", params)  # (Gemma 3: the global layers')


def _tensors(arch, state, config, layer_map):
    """(GGUF name, float32 array) per tensor, as llama.cpp's converter changes them."""
    state = {mixtral_name(n): t for n, t in state.items()}
    _stack_experts(state)
    for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
        gate, up = state.pop(name).chunk(2, dim=1)  # transformers' [experts, 2 I, H]
        state[name.replace("gate_up_proj", "gate_exps")] = gate
        state[name.replace("gate_up_proj", "up_exps")] = up
    for name in [n for n in state if n.endswith("mlp.experts.down_proj")]:
        state[name.replace("down_proj", "down_exps")] = state.pop(name)
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if arch in gguf_archs.NORMS_PLUS_ONE and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's Gemma norms hold 1 + w
        if name.endswith(("gate_exps", "up_exps", "down_exps")):  # every expert in one
            yield f"blk.{name.split('.')[2]}.ffn_{name.rsplit('.', 1)[1]}.weight", w
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            yield {v: k for k, v in gguf_archs.GLOBAL_NAMES.items()}[name], w
            continue
        layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
        rest = rest.replace(".shared_experts.", ".shared_expert.")
        if rest == "self_attn.kv_b_proj.weight":  # llama.cpp's MLA files: two halves
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            kv_b = w.reshape(heads, nope + config.v_head_dim, -1)
            yield f"blk.{layer}.attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1).copy()
            yield f"blk.{layer}.attn_v_b.weight", kv_b[:, nope:].copy()
            continue
        if arch in gguf_archs.PERMUTED_QK and rest.startswith("self_attn.q_proj"):
            w = llama_cpp_permute(w, config.num_attention_heads)
        elif arch in gguf_archs.PERMUTED_QK and rest.startswith("self_attn.k_proj"):
            w = llama_cpp_permute(w, config.num_key_value_heads)
        yield f"blk.{layer}.{layer_map[rest]}", w


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _stack_experts(state: dict) -> None:
    """Per-expert tensors (checkpoints as the hub ships them, and as transformers saves
    them) stacked into llama.cpp's one tensor per layer and kind, in expert order."""
    groups: dict[tuple[str, str], dict[int, object]] = {}
    for name in [n for n in state if _EXPERT.fullmatch(n)]:
        prefix, expert, kind = _EXPERT.fullmatch(name).groups()
        groups.setdefault((prefix, kind), {})[int(expert)] = state.pop(name)
    for (prefix, kind), parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"{prefix}: experts {sorted(parts)} are not 0..{len(parts) - 1}.")
        state[f"{prefix}.{kind}_exps"] = torch.stack([parts[e] for e in range(len(parts))])


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
    rope = _rope(config)
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
    rope = _rope(config)
    original = getattr(config, "original_max_position_embeddings", None) or \
        config.max_position_embeddings
    writer.add_rope_dimension_count(head_dim(config))
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
    rope = _rope(config)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


_ARCH_KEYS = {"llama": _llama_keys, "gemma2": _gemma_keys, "gemma3": _gemma_keys,
              "phi3": _phi3_keys, "deepseek2": _deepseek2_keys}


def write_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """A tokenizer as llama.cpp's `tokenizer.ggml.*` keys: tokens in id order with their
    types (control for special tokens, user-defined for other added ones), the special ids,
    the chat template. A byte-level BPE (GPT-2 style: Llama 3, Qwen, SmolLM, ...) as `gpt2`
    with its merges; a SentencePiece BPE (tokenizer.json of type BPE with byte fallback:
    Llama 2, Mistral, Gemma, Phi-3, ...) as `llama` with scores (each merged token's score is
    minus its merge's rank, the order SentencePiece merges in) and byte tokens. The list is
    padded to the embedding's `vocab_size` rows with unused `[PAD{i}]` entries, as llama.cpp's
    converter does (llama.cpp checks that the two agree)."""
    import json

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state.get("model", {})
    if model.get("type") != "BPE" or model.get("merges") is None:
        raise ValueError("Only BPE tokenizers (tokenizer.json of type BPE: byte-level, or "
                         "SentencePiece's with byte fallback) can be written to GGUF yet.")
    spm = bool(model.get("byte_fallback"))
    vocab = tokenizer.get_vocab()
    size = max(max(vocab.values()) + 1, vocab_size)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf_token_type("unused")] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf_token_type("normal")
    for added in state.get("added_tokens", []):
        types[added["id"]] = gguf_token_type("control" if added.get("special")
                                             else "user_defined")
    if spm:  # (byte-fallback pieces <0x00>..<0xFF>, however the tokenizer lists them)
        for text, i in vocab.items():
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
                types[i] = gguf_token_type("byte")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    if spm:
        scores = [0.0] * size
        for rank, merge in reversed(list(enumerate(merges))):  # (the first merge wins)
            merged = vocab.get(merge.replace(" ", "", 1))
            if merged is not None:
                scores[merged] = -float(rank)
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None:
            types[unk] = gguf_token_type("unknown")
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_token_merges(merges)  # (llama.cpp merges by score; transformers reads these)
        writer.add_add_space_prefix(_adds_space_prefix(state))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            getattr(writer, f"add_{name}_token_id")(token_id)
    add_bos, add_eos = _adds_bos_eos(tokenizer)
    writer.add_add_bos_token(add_bos)
    if spm:
        writer.add_add_eos_token(add_eos)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def _adds_bos_eos(tokenizer) -> tuple[bool, bool]:
    """Whether encoding puts BOS before / EOS after the text (read from what it does: the
    `add_bos_token` attribute is not kept by every tokenizer class)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    extra = len(full) > len(plain)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return (extra and bos is not None and full[0] == bos,
            extra and eos is not None and full[-1] == eos)


def _adds_space_prefix(state: dict) -> bool:
    """Whether the SentencePiece tokenizer puts "▁" before the text (a Prepend normalizer, or
    a Metaspace pre-tokenizer that prepends)."""
    def parts(node):
        if not node:
            return []
        return [p for child in node.get("normalizers") or node.get("pretokenizers") or []
                for p in parts(child)] or [node]
    return any(p.get("type") == "Prepend" for p in parts(state.get("normalizer"))) or any(
        p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
        for p in parts(state.get("pre_tokenizer")))


def gguf_token_type(kind: str) -> int:
    import gguf

    return {"normal": gguf.TokenType.NORMAL, "control": gguf.TokenType.CONTROL,
            "user_defined": gguf.TokenType.USER_DEFINED, "unused": gguf.TokenType.UNUSED,
            "byte": gguf.TokenType.BYTE, "unknown": gguf.TokenType.UNKNOWN}[kind]
