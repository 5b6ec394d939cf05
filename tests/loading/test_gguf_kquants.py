"""GGUF K-quant files served as they are stored: Q4_K and Q6_K layers keep their bits, byte
scales and per-256 factors, Q5_0 / Q5_1 their fifth bits apart and fp16 factors
(csrc/kquant_panels.c), so the model's resident weight bytes stay
within 1.1x of the file's tensor bytes; their tokens are those of the same file expanded to
float (within the 15-bit activation rounding); the compiled decode step and two
tensor-parallel ranks take them. TOKENMILL_GGUF_COMPACT=0 widens Q6_K to int8 instead."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import make_model

from tokenmill import LLM, SamplingParams, csrc
from tokenmill.convert.gguf_writer import write_gguf
from tokenmill.layers.linear import Linear
from tokenmill.loading import gguf as gguf_loader
from tokenmill.quantization import schemes
from tokenmill.quantization.gguf_blocks import BLOCKS

pytestmark = pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]


def random_blocks(kind, shape, seed=0):
    """Random `kind` blocks for a weight of `shape` ([.., N, K]), their fp16 factors small
    and positive (random bits there could be inf or NaN)."""
    rng = np.random.default_rng(seed + shape[-2])
    size, nbytes = BLOCKS[kind]
    lead = tuple(shape[:-1])
    raw = rng.integers(0, 256, size=(*lead, shape[-1] // size, nbytes), dtype=np.uint8)
    for at in {"Q6_K": [208], "Q4_K": [0, 2], "Q5_0": [0], "Q5_1": [0, 2]}[kind]:
        d = rng.uniform(0.0002, 0.001, size=(*lead, shape[-1] // size)).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(*lead, shape[-1] // size, 2)
    return raw.reshape(*lead, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 5, 13, 40])
def test_kernel_against_the_dequantized_weight(kind, rows, monkeypatch):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from tokenmill.quantization.model import KERNELS

    shape = (96, 512)
    raw = random_blocks(kind, shape)
    shard = gguf_loader._quantized_shard(raw, kind, list(shape))
    kernel = KERNELS[shard.method](shard.tensors)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])).reshape(shape)
    assert torch.equal(kernel.dequantize(), weight)
    for leaf, t in shard.tensors.items():  # read back from the panels
        assert torch.equal(kernel.tensors[leaf], t), leaf
    ids = torch.tensor([0, 95, 17, 17])
    assert torch.equal(kernel.rows(ids), weight[ids])
    lin = Linear(shape[1], shape[0], True)
    lin.bias.data.normal_()
    x = torch.randn(rows, shape[1])
    expected = F.linear(schemes.fake_quantize_blocks(x, top=schemes.SPLIT_TOP), weight,
                        lin.bias)
    # float sums in another order: within 1e-5 of the outputs' scale
    torch.testing.assert_close(kernel.apply(lin, x), expected, rtol=1e-4,
                               atol=1e-5 * float(expected.abs().max()))
    assert kernel.weight_bytes() <= 1.07 * raw.nbytes


def test_activations_split_into_two_int8_halves():
    """The K-quant kernels' activations: per 32 inputs integers a up to SPLIT_TOP (the
    reference rounding), stored as 256 hi + lo with both halves int8, with their scales,
    block sums and sums per 16 inputs."""
    torch.manual_seed(0)
    x = torch.randn(3, 512) * torch.logspace(-3, 2, 512)  # blocks of very different scales
    x[1, 64:96] = 0.0  # an all-zero block
    xq, xs, xsum, hsum = csrc.quantize_rows_q8x2(x)
    hi, lo = xq[:, 0].int(), xq[:, 1].int()
    assert hi.abs().max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    a = hi * 256 + lo
    blocks = x.view(3, -1, 32)
    amax = blocks.abs().amax(-1)
    expected = schemes.fake_quantize_blocks(x, top=schemes.SPLIT_TOP)
    assert torch.equal(xs, amax / schemes.SPLIT_TOP)
    # the reference's x * (top / amax) may round apart from the kernel's at a tie: one step
    step = xs[..., None].expand(3, -1, 32)
    error = (a.view(3, -1, 32).float() * xs[..., None] - expected.view(3, -1, 32)).abs()
    assert (error <= step * 1.01).all() and (error > 1e-3 * step).float().mean() < 0.01
    assert torch.equal(hsum, a.view(3, -1, 16).sum(-1))
    assert torch.equal(xsum, xs * a.view(3, -1, 32).sum(-1).float())


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A Llama-shaped model (inputs multiples of 256) as llama.cpp's Q4_K_M mixes blocks:
    Q6_K for attn_v, ffn_down and the tied embedding, Q4_K for the rest; but attn_output and
    ffn_gate in Q5_0 (what Q4_K_M takes for rows whose length is not a multiple of 256, as
    Qwen2-0.5B's 896)."""
    path = tmp_path_factory.mktemp("kq")
    hf_path = str(path / "hf")
    hf = make_model(hf_path, "llama", hidden_size=256, intermediate_size=512,
                    tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64)
    from gguf import GGMLQuantizationType as T

    def qtype(name):
        if name.endswith(("attn_v.weight", "ffn_down.weight", "token_embd.weight")):
            return T.Q6_K
        if name.endswith(("attn_output.weight", "ffn_gate.weight")):
            return T.Q5_0
        return T.Q4_K if name.endswith("weight") and "norm" not in name else None

    file = str(path / "q4_k_m.gguf")
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    write_gguf(file, "llama", state, hf.config, qtype,
               blocks=lambda kind, shape: random_blocks(kind.name, shape))
    return file, hf_path


def _run(path, hf_path, **engine):
    gguf_loader._reader.cache_clear()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    with LLM(path, tokenizer=hf_path, kv_cache_memory_gib=0.01, **engine) as llm:
        runner = llm.engine.core.runner
        from tokenmill.quantization.model import weight_bytes

        info = {"bytes": weight_bytes(runner.model), "step": runner.decode_step is not None,
                "kernels": {m.kernel.name for m in runner.model.modules()
                            if hasattr(m, "kernel")}}
        outs = [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    return info, outs


def test_q6_k_widens_to_int8_when_asked(q4_k_m, monkeypatch):
    """With TOKENMILL_GGUF_COMPACT=0 Q6_K blocks become int8 groups of 16 and Q5 blocks int8
    groups of 32 (exactly): more memory than the file."""
    from gguf import GGUFReader

    monkeypatch.setenv("TOKENMILL_GGUF_COMPACT", "0")
    path, hf_path = q4_k_m
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    info, _ = _run(path, hf_path)
    assert any("q4k-cpu" in k for k in info["kernels"])
    assert not {"q6k-cpu", "q5_0-cpu"} & info["kernels"]
    assert any(k.startswith("int8") for k in info["kernels"]) and info["step"]
    assert 1.1 * file_bytes < info["bytes"] < 1.5 * file_bytes


def test_a_q4_k_m_file_stays_its_size_and_gives_the_expanded_tokens(q4_k_m, monkeypatch):
    from gguf import GGUFReader

    path, hf_path = q4_k_m
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    info, kept = _run(path, hf_path)
    assert {"q6k-cpu", "q5_0-cpu", "parts:q4k-cpu+q4k-cpu+q6k-cpu",
            "parts:q5_0-cpu+q4k-cpu"} <= info["kernels"]
    assert info["step"]
    assert info["bytes"] <= 1.1 * file_bytes, (info["bytes"], file_bytes)
    two, split = _run(path, hf_path, tensor_parallel_size=2)
    assert [o.token_ids for o in split] == [o.token_ids for o in kept]
    # the compiled decode step (q|k|v's parts apart, as PARTS) equals the layer-by-layer run
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")
    layered_info, layered = _run(path, hf_path)
    assert not layered_info["step"]
    for a, b in zip(kept, layered, strict=True):
        assert a.token_ids == b.token_ids
        for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 for t in pa.keys() & pb.keys())
    monkeypatch.delenv("TOKENMILL_CPU_DECODE_STEP")
    monkeypatch.setattr(csrc, "available", lambda: False)  # the same blocks expanded to float
    expanded_info, expanded = _run(path, hf_path)
    assert expanded_info["bytes"] > 3 * file_bytes
    # the integer kernels round activations to 15 bits per 32 inputs (relative ~1e-5 a layer,
    # grown through these random weights): the same tokens, the sampled ones' logprobs close
    for a, b in zip(kept, expanded, strict=True):
        assert a.token_ids == b.token_ids
        for token, pa, pb in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
            assert abs(pa[token].logprob - pb[token].logprob) < 1e-2


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q5_1"])
def test_a_large_table_converted_a_slice_at_a_time_is_the_whole_conversion(kind,
                                                                           monkeypatch):
    """to_kernel_tensors converts a table of more than ROW_CHUNK rows in slices (so its
    temporaries are a slice's): the tensors equal converting all rows at once."""
    from tokenmill.quantization import gguf_blocks

    raw = random_blocks(kind, (50, 256))
    whole = gguf_blocks.to_kernel_tensors(raw, kind, 50, 256)
    monkeypatch.setattr(gguf_blocks, "ROW_CHUNK", 16)  # 50 rows: 16 + 16 + 16 + 2
    sliced = gguf_blocks.to_kernel_tensors(raw, kind, 50, 256)
    assert sliced[0] == whole[0] and sliced[1].keys() == whole[1].keys()
    for leaf, t in whole[1].items():
        assert torch.equal(sliced[1][leaf], t), leaf


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q5_1"])
def test_panels_built_a_slice_at_a_time_are_the_whole_blob(kind, monkeypatch):
    """kquant_blob builds a layer's panels about BLOB_CHUNK_BYTES of rows at a time (so the
    regrouping's temporaries are a slice's): the same bytes as building them all at once,
    the last panel's channels past N included, and the rows read back from them."""
    from tokenmill.csrc import kquant
    from tokenmill.quantization import gguf_blocks

    raw = random_blocks(kind, (50, 256))
    method, tensors = gguf_blocks.to_kernel_tensors(raw, kind, 50, 256)
    whole = kquant.kquant_blob(method, tensors)
    monkeypatch.setattr(kquant, "BLOB_CHUNK_BYTES", 1)  # one panel a slice: 16 + 16 + 16 + 2
    sliced = kquant.kquant_blob(method, tensors)
    assert torch.equal(sliced, whole)
    back = kquant.kquant_rows(method, sliced, 256, torch.arange(50))
    for leaf, t in tensors.items():
        assert torch.equal(back[leaf], t), leaf
