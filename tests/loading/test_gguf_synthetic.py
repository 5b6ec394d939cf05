"""GGUF files written here with gguf.GGUFWriter load back to the HF tensors they came from."""

import os
import types

import numpy as np
import pytest
import torch
from helpers import head_dim

from tokenmill import csrc
from tokenmill.convert.gguf_writer import write_gguf
from tokenmill.loading import gguf as gguf_loader
from tokenmill.quantization import schemes


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


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(128, 896), (4864, 896), (896, 4864)])
def test_blocks_kept_quantized_match_ggufs_dequantizer_at_real_sizes(qtype, shape):
    """Blocks served as they are (int8 / int4 kernel tensors) hold the weights `gguf`'s own
    dequantizer gives, at Qwen2.5-0.5B's projection shapes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from tokenmill.quantization.model import KERNELS

    kind = GGMLQuantizationType[qtype]
    blocks = quantize(np.random.default_rng(0).standard_normal(shape, dtype=np.float32), kind)
    shard = gguf_loader._quantized_shard(blocks, qtype, list(shape))
    ours = KERNELS[shard.method](shard.tensors).dequantize()
    assert ours.shape == shape
    torch.testing.assert_close(ours, torch.from_numpy(dequantize(blocks, kind)),
                               rtol=1e-6, atol=1e-6)


def test_llama31_rope_freqs_are_read(tmp_path, tiny_models):
    """A Llama 3.1-style file (llama.cpp stores its rope scaling as `rope_freqs`, one divisor
    per rotary frequency) gives transformers' tokens past the original context length."""
    from helpers import hf_greedy

    from tokenmill import LLM, SamplingParams

    hf_path, hf = tiny_models("llama3")  # original_max_position_embeddings 64, factor 8
    path = str(tmp_path / "llama31.gguf")
    write_gguf(path, "llama", hf.state_dict(), hf.config)
    gguf_loader._reader.cache_clear()
    config = gguf_loader.load_gguf_config(path)
    assert len(config.rope_parameters["freq_factors"]) == head_dim(hf.config) // 2
    prompt = list(range(3, 103))  # positions past 64, where the scaling matters
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, tokenizer=hf_path, kv_cache_memory_gib=0.01) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def random_blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    """Random bytes of `kind` blocks for an [n, k] weight, their fp16 scale fields set to
    small positive values (random bits there could be inf or NaN)."""
    from tokenmill.quantization.gguf_blocks import BLOCKS

    size, nbytes = BLOCKS[kind]
    raw = rng.integers(0, 256, size=(n, k // size, nbytes), dtype=np.uint8)
    fields = {"Q6_K": [208], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2],
              "Q5_1": [0, 2], "Q2_K": [80, 82]}.get(kind, [0])
    for offset in fields:
        d = rng.uniform(0.001, 0.05, size=(n, k // size)).astype(np.float16)
        raw[..., offset:offset + 2] = d.view(np.uint8).reshape(n, k // size, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q6_K", "Q5_K", "Q3_K", "Q4_K", "Q2_K"])
@pytest.mark.parametrize("shape", [(256, 1024), (1024, 512)])
def test_k_quant_and_q5_blocks_match_ggufs_dequantizer(kind, shape, monkeypatch):
    """Q5_K, Q3_K and Q2_K become int8 tensors exactly (Q5_K and Q2_K with float offsets per
    group), Q4_K, Q6_K, Q5_0 and Q5_1 stay as stored (kquant_kernels.py), exactly, or Q6_K /
    Q5 int8 with TOKENMILL_GGUF_COMPACT=0; and each kernel's product, at decode and prompt
    row counts, is the dequantized weight's (within the activation rounding)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from tokenmill.quantization.model import KERNELS

    raw = random_blocks(kind, *shape, np.random.default_rng(0))
    shard = gguf_loader._quantized_shard(raw, kind, list(shape))
    assert shard.method == {"Q4_K": "q4k", "Q6_K": "q6k", "Q5_0": "q5_0",
                            "Q5_1": "q5_1"}.get(kind, "int8")
    kernel = KERNELS[shard.method](shard.tensors)
    ours = kernel.dequantize()
    theirs = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])).reshape(shape)
    if kind in ("Q6_K", "Q5_0", "Q5_1"):
        monkeypatch.setenv("TOKENMILL_GGUF_COMPACT", "0")
        widened = gguf_loader._quantized_shard(raw, kind, list(shape))
        assert widened.method == "int8"
        assert torch.equal(KERNELS["int8"](widened.tensors).dequantize(), theirs)
    assert torch.equal(ours, theirs)
    for rows in (1, 5, 40):  # (each row count's kernel: GEMV, small tiles, panels)
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
        expect = x @ theirs.T
        torch.testing.assert_close(kernel.apply(types.SimpleNamespace(bias=None), x), expect,
                                   rtol=0, atol=1e-3 * float(expect.abs().max()))


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
@pytest.mark.parametrize("k", [896, 96])
def test_q5_kept_where_k_is_a_multiple_of_64(kind, k):
    """Q5 rows of 896 inputs (Qwen2-0.5B's hidden size: not a multiple of 256, the reason
    llama.cpp stores them in Q5_0) are kept as stored and multiply at the file's size; rows
    of 96 (not a multiple of the kernel's 64) are widened to int8. Both equal gguf's
    dequantizer; the compiled product equals the dequantized weight's within the 15-bit
    activation rounding."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from tokenmill.quantization.model import KERNELS

    n = 40  # two and a half panels of 16 channels
    raw = random_blocks(kind, n, k, np.random.default_rng(1))
    shard = gguf_loader._quantized_shard(raw, kind, [n, k])
    theirs = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])).reshape(n, k)
    kernel = KERNELS[shard.method](shard.tensors)
    assert shard.method == (kind.lower() if k % 64 == 0 else "int8")
    assert torch.equal(kernel.dequantize(), theirs)
    if k % 64 == 0 and csrc.available():
        assert kernel.name == f"{kind.lower()}-cpu"
        assert kernel.weight_bytes() <= raw.nbytes * 48 // 40  # the last panel's padding
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
        expect = schemes.fake_quantize_blocks(x, top=schemes.SPLIT_TOP) @ theirs.T
        torch.testing.assert_close(kernel.apply(types.SimpleNamespace(bias=None), x), expect,
                                   rtol=1e-5, atol=1e-5 * float(expect.abs().max()))



def test_a_gguf_tokenizer_read_back_from_the_cache_is_the_one_built(tmp_path, monkeypatch):
    """The tokenizer transformers builds from a GGUF's metadata is kept in the cache; the
    next load reads it from there and encodes, decodes and renders chats the same."""
    from tokenmill.loading.gguf import default_model_path
    from tokenmill.loading.gguf_tokenizer import _tokenizer_cache, load_gguf_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default_model_path()
    built = load_gguf_tokenizer(path)
    folder = _tokenizer_cache(path)
    assert folder.startswith(str(tmp_path)) and os.path.isfile(folder + "/tokenizer.json")
    cached = load_gguf_tokenizer(path)
    assert type(cached) is type(built) and len(cached) == len(built)
    texts = ["The capital of France is", "<|im_start|>user\nhi<|im_end|>", " spaces  and\ttabs",
             "émigré 東京 🙂", ""]
    for text in texts:
        assert cached.encode(text) == built.encode(text), text
        assert cached.decode(built.encode(text)) == built.decode(built.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        built.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (cached.bos_token_id, cached.eos_token_id, cached.all_special_ids) == \
        (built.bos_token_id, built.eos_token_id, built.all_special_ids)


def test_the_plain_view_reader_reads_what_ggufs_reader_reads():
    """The loader's reader (gguf's parser over a plain view of the map, for speed) gives the
    same fields, values and tensor bytes as gguf's own reader of the file."""
    from gguf import GGUFReader

    path = gguf_loader.default_model_path()
    ours, theirs = gguf_loader._reader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, list(mine.shape)) == \
            (ref.name, ref.tensor_type, list(ref.shape))
        assert np.array_equal(mine.data, ref.data), mine.name


def test_a_tokenizer_that_does_not_read_back_alike_is_not_cached(tmp_path, monkeypatch):
    """transformers' save and load does not round-trip every GGUF tokenizer (a SentencePiece
    vocabulary came back without its unknown token; test_convert's gemma2 round trip): such a
    copy is never cached, and every start builds the tokenizer again."""
    from tokenmill.loading import gguf_tokenizer as loader
    from tokenmill.loading.gguf import default_model_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default_model_path()
    real = loader._reads_back_alike
    assert real(loader._build_gguf_tokenizer(path), str(tmp_path / "missing")) is False
    monkeypatch.setattr(loader, "_reads_back_alike", lambda tokenizer, folder: False)
    loader.load_gguf_tokenizer(path)
    assert not os.path.exists(loader._tokenizer_cache(path))
    assert not os.listdir(os.path.dirname(loader._tokenizer_cache(path)))  # no stray copy
    monkeypatch.setattr(loader, "_reads_back_alike", real)
    built = loader.load_gguf_tokenizer(path)
    assert os.path.isfile(loader._tokenizer_cache(path) + "/tokenizer.json")
    assert loader.load_gguf_tokenizer(path).encode(loader._PROBE) == built.encode(loader._PROBE)
