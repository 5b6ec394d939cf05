"""GGUF files as llama.cpp's converter (convert_hf_to_gguf.py) writes them, from a
transformers model's tensors: what `tokenmill convert --to gguf` writes, and the tests'
stand-in for downloaded GGUF files. Q and K rows permuted for llama.cpp's rope, Gemma norms
stored as 1 + w, experts stacked, MLA's kv_b split in two, the metadata keys llama.cpp reads;
the tokenizer (BPE) and chat template in the metadata when given."""

from __future__ import annotations

import re

import numpy as np
import torch

from tokenmill.convert.gguf_keys import ARCH_KEYS, head_dim, rope_settings
from tokenmill.loading import gguf_archs, gguf_state_archs
from tokenmill.models.moe import mixtral_name

LAYER_MAP = {v: k for k, v in gguf_archs.LAYER_NAMES.items()}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to Q/K rows of Llama-type models."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


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
    rope = rope_settings(config)
    writer.add_block_count(config.num_hidden_layers)
    if arch != "mamba2":  # (no attention: gguf_keys.py writes its keys)
        _attention_keys(writer, arch, config, rope)
    extra = ARCH_KEYS.get(arch, lambda writer, config: {})(writer, config) or {}
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
        kind = (mixes.fitting(kind, w.shape[-1])
                if w.ndim >= 2 and not mixes.stays_float(gname) else None)
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


def _attention_keys(writer, arch, config, rope) -> None:
    """The keys every attention family's file has."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    # (Llama 4: its dense layers' size; its experts' under expert_feed_forward_length)
    writer.add_feed_forward_length(getattr(config, "intermediate_size_mlp", None)
                                   or config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    if arch != "deepseek2":  # (MLA files describe the latent cache row instead)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    if getattr(config, "rms_norm_eps", None) is not None:  # (LayerNorm families: their keys)
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


def _encode(w: np.ndarray, kind) -> np.ndarray:
    """`w` in block type `kind`: K-quants by kquants.py, the rest by gguf-py."""
    from gguf.quants import quantize

    from tokenmill.convert.kquants import QUANTIZERS

    if kind.name in QUANTIZERS:
        return QUANTIZERS[kind.name](w.reshape(-1, w.shape[-1])).reshape(*w.shape[:-1], -1)
    return quantize(w, kind)


def _tensors(arch, state, config, layer_map):
    """(GGUF name, float32 array) per tensor, as llama.cpp's converter changes them."""
    if arch == "granitemoe":
        state = _granite_moe_names(state)
    if arch == "gpt-oss":
        state = _gpt_oss_experts(state)
    if arch == "llama4":  # ([experts, in, out] stacks, as the other MoEs' [experts, out, in])
        state = {n.replace(".feed_forward.experts.", ".mlp.experts."):
                 t.transpose(1, 2) if ".feed_forward.experts." in n else t
                 for n, t in state.items()}
    state = {mixtral_name(n): t for n, t in state.items()}
    _stack_experts(state)
    for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
        gate, up = state.pop(name).chunk(2, dim=1)  # transformers' [experts, 2 I, H]
        state[name.replace("gate_up_proj", "gate_exps")] = gate
        state[name.replace("gate_up_proj", "up_exps")] = up
    for name in [n for n in state if n.endswith("mlp.experts.down_proj")]:
        state[name.replace("down_proj", "down_exps")] = state.pop(name)
    globals_ = {v: k for k, v in gguf_archs.global_names(arch).items()}
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if arch in gguf_archs.NORMS_PLUS_ONE and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's Gemma norms hold 1 + w
        if name.endswith(("gate_exps", "up_exps", "down_exps")):  # every expert in one
            yield f"blk.{name.split('.')[2]}.ffn_{name.rsplit('.', 1)[1]}.weight", w
            continue
        if name.endswith(("gate_exps_bias", "up_exps_bias", "down_exps_bias")):
            kind = name.rsplit(".", 1)[1].removesuffix("_bias")
            yield f"blk.{name.split('.')[2]}.ffn_{kind}.bias", w
            continue
        if arch in gguf_state_archs.ARCHITECTURES:
            yield from _state_tensor(arch, name, w, config, layer_map, globals_)
            continue
        if not name.startswith("model.layers."):
            yield globals_[name], w
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


def _state_tensor(arch, name, w, config, layer_map, globals_):
    """A tensor of Mamba-2 or Qwen3-Next as llama.cpp's converter writes it
    (loading/gguf_state_archs.py); their experts go the common way above."""
    w = gguf_state_archs.to_gguf(arch, name, w, config)
    if name in globals_:
        yield globals_[name], w
        return
    layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
    if rest == "linear_attn.in_proj_qkvz.weight":
        qkv, z = gguf_state_archs.split_qkvz(w, config)
        yield f"blk.{layer}.attn_qkv.weight", qkv
        yield f"blk.{layer}.attn_gate.weight", z
        return
    yield f"blk.{layer}.{layer_map[rest]}", w


def _gpt_oss_experts(state: dict) -> dict:
    """gpt-oss' stacked experts ([experts, in, out], gate and up interleaved column by
    column) as llama.cpp's converter writes them: [experts, out, in], gate and up apart,
    each kind's biases one [experts, out] tensor."""
    out = {}
    for name, tensor in state.items():
        stem = name.rsplit(".", 1)[0] + "."  # model.layers.N.mlp.experts.
        if name.endswith("mlp.experts.gate_up_proj"):
            w = tensor.transpose(1, 2)
            out[stem + "gate_exps"], out[stem + "up_exps"] = w[:, 0::2], w[:, 1::2]
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            out[stem + "gate_exps_bias"] = tensor[:, 0::2]
            out[stem + "up_exps_bias"] = tensor[:, 1::2]
        elif name.endswith("mlp.experts.down_proj"):
            out[stem + "down_exps"] = tensor.transpose(1, 2)
        elif name.endswith("mlp.experts.down_proj_bias"):
            out[stem + "down_exps_bias"] = tensor
        else:
            out[name] = tensor
    return out


# (as saved, and as transformers holds them in memory)
_GRANITE_NAMES = ((".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
                  (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
                  (".block_sparse_moe.router.layer.", ".mlp.gate."),
                  (".block_sparse_moe.router.", ".mlp.gate."),
                  (".block_sparse_moe.experts.", ".mlp.experts."),
                  (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."))


def _granite_moe_names(state: dict) -> dict:
    """Granite-MoE's tensors under the names the other mixtures of experts use: its stacked
    experts as transformers' gate_up / down stacks, the shared expert's gate | up split (as
    llama.cpp's converter splits them)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".shared_mlp.input_linear.weight"):
            prefix = name.removesuffix("shared_mlp.input_linear.weight")
            gate, up = tensor.chunk(2, dim=0)
            out[prefix + "mlp.shared_expert.gate_proj.weight"] = gate
            out[prefix + "mlp.shared_expert.up_proj.weight"] = up
            continue
        for theirs, ours in _GRANITE_NAMES:
            name = name.replace(theirs, ours)
        out[name] = tensor
    return out


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
