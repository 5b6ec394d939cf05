"""GGUF files written here with gguf.GGUFWriter load back to the HF tensors they came from."""

import numpy as np
import pytest
import torch

from tokenmill import gguf_loader

LAYER_MAP = {v: k for k, v in gguf_loader._LAYER_NAMES.items()}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to Q/K rows of Llama-type models."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_gguf(path, arch, state, config):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    for name, tensor in state.items():
        w = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
            gname = f"blk.{layer}.{LAYER_MAP[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                w = llama_cpp_permute(w, config.num_attention_heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                w = llama_cpp_permute(w, config.num_key_value_heads)
        writer.add_tensor(gname, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_round_trip_to_hf_tensors(tmp_path, arch):
    from helpers import make_model

    hf = make_model(str(tmp_path / "hf"), arch)
    state = {k: v for k, v in hf.state_dict().items()
             if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, state, hf.config)
    gguf_loader._reader.cache_clear()
    config = gguf_loader.load_gguf_config(str(path))
    assert config.architectures == [type(hf).__name__]
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size"):
        assert getattr(config, key) == getattr(hf.config, key), key
    assert config.head_dim == head_dim(hf.config)
    loaded = dict(gguf_loader.iter_gguf_weights(str(path), config))
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="Unsupported GGUF architecture 'mamba'"):
        gguf_loader.load_gguf_config(str(path))
