"""gpt-oss as OpenAI ships it: MXFP4 experts read exactly (the int8 form, and the fp4 panels
VNNI CPUs keep them in), against transformers' own MXFP4 reading and its model over the
same (dequantized) weights."""

import json

import pytest
import torch
from helpers import hf_greedy, make_model
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tokenmill import LLM, SamplingParams, csrc
from tokenmill.quantization.linear_kernels import Int8Kernel
from tokenmill.quantization.mxfp4 import Mxfp4Kernel, dequantize_mxfp4, mxfp4_int8
from tokenmill.quantization.schemes import dequantize_int8

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]


def _random_mxfp4(gen, *shape):
    """blocks [..., G, 16] and scales [..., G] of weights of a realistic size."""
    *lead, inputs = shape
    blocks = torch.randint(0, 256, (*lead, inputs // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 126, (*lead, inputs // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_reads_as_transformers_reads_it_and_int8_holds_it_exactly():
    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4(gen, 3, 48, 64)  # [experts, out, in]
    scales[0, 0, 0], scales[1, 2, 1] = 0, 254  # (the extremes of the exponent)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs.transpose(1, 2))  # (theirs: [experts, in, out])
    for e in range(3):
        shard = mxfp4_int8(blocks[e], scales[e])
        assert shard.method == "mxfp4" and shard.tensors["qweight"].abs().max() <= 12
        assert torch.equal(dequantize_int8(shard.tensors["qweight"], shard.tensors["scale"]),
                           ours[e])


class _Layer:
    bias = None


@pytest.mark.parametrize("n,k", [(48, 64), (35, 96), (16, 2880)])
def test_fp4_panels_hold_the_weights_and_give_the_int8_panels_sums(n, k):
    """The fp4 panels (codes in int4's nibble panels, bfloat16 scales) hold the MXFP4
    weights exactly (every exponent from 0 to 254) at half the int8 form's bytes, and the
    fp4 panel kernel's outputs equal the int8 kernel's on the same weights bit for bit."""
    gen = torch.Generator().manual_seed(n)
    blocks, scales = _random_mxfp4(gen, n, k)
    scales[0, 0], scales[-1, -1] = 0, 254
    shard = mxfp4_int8(blocks, scales)
    fp4, int8 = Mxfp4Kernel(dict(shard.tensors)), Int8Kernel(dict(shard.tensors))
    weights = dequantize_mxfp4(blocks, scales)
    assert torch.equal(fp4.dequantize(), weights)
    assert torch.equal(fp4.rows(torch.tensor([0, n - 1])), weights[[0, n - 1]])
    assert all(torch.equal(a, b) for a, b in zip(fp4.tensors.values(), shard.tensors.values()))
    x = torch.randn(5, k, generator=gen)
    assert torch.equal(fp4.apply(_Layer, x), int8.apply(_Layer, x))
    if fp4.fp4:
        assert fp4.name == "mxfp4-cpu-vnni" and 2 * fp4.weight_bytes() == int8.weight_bytes()


def test_fp4_panels_of_cpus_without_avx512_give_the_same_sums(tmp_path):
    """vnni_panels.c built without AVX-512 (its vpmaddwd path, the fp4 codes looked up with
    vpshufb): the same int32 sums and float operations, so the same outputs, fp4 and int8."""
    import ctypes

    from helpers import build_kernels_without

    from tokenmill.csrc.build import address
    from tokenmill.quantization.mxfp4 import _fp4_panels

    lib = build_kernels_without(tmp_path, ["-mno-avx512f"], "vnni_panels.c")
    lib.tm_vnni_native.restype = ctypes.c_int64
    assert lib.tm_vnni_native() == 0
    gen = torch.Generator().manual_seed(3)
    n, k, m = 40, 128, 3
    shard = mxfp4_int8(*_random_mxfp4(gen, n, k))
    x = torch.randn(m, k, generator=gen)
    xq, xs, _ = csrc.quantize_rows_q16(x)
    wp, sp = _fp4_panels(shard.tensors["qweight"], shard.tensors["scale"])
    y = torch.empty(m, n)
    i64 = ctypes.c_int64
    lib.tm_fp4_vnni_gemm(*(ctypes.c_void_p(address(t)) for t in (xq, xs, wp, sp)), None,
                         ctypes.c_void_p(address(y)), i64(m), i64(n), i64(k))
    expected = Int8Kernel(dict(shard.tensors))
    if expected.vnni:  # (the AVX-512 build's int8 panels: the same sums)
        assert torch.equal(y, expected.apply(_Layer, x))
    torch.testing.assert_close(y, x @ dequantize_mxfp4(*_random_mxfp4(
        torch.Generator().manual_seed(3), n, k)).T, atol=0.05, rtol=0.02)


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """A tiny gpt-oss whose experts are stored as MXFP4 (its config's quantization_config
    says so, as OpenAI's do), and transformers' model over the same weights dequantized."""
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf = make_model(str(path), "gpt_oss")
    gen = torch.Generator().manual_seed(1)
    state = {k: v for k, v in hf.state_dict().items()}
    config = hf.config
    inter, hidden = config.intermediate_size, config.hidden_size
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        for kind, out, inputs in (("gate_up_proj", 2 * inter, hidden),
                                  ("down_proj", hidden, inter)):
            blocks, scales = _random_mxfp4(gen, config.num_local_experts, out, inputs)
            del state[prefix + kind]
            state[prefix + kind + "_blocks"] = blocks
            state[prefix + kind + "_scales"] = scales
            with torch.no_grad():  # transformers' layout: [experts, in, out]
                getattr(hf.model.layers[i].mlp.experts, kind).copy_(
                    dequantize_mxfp4(blocks, scales).transpose(1, 2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "mxfp4",
                                   "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(data))
    return str(path), hf


@pytest.mark.parametrize("engine,kernels", [({}, "compiled"), ({}, "torch"),
                                            ({"tensor_parallel_size": 2}, "compiled")])
def test_mxfp4_checkpoint_equals_transformers(mxfp4_model, monkeypatch, engine, kernels):
    """Greedy tokens equal transformers'; logprobs within 1e-4 where the int8 kernel's
    torch form multiplies by the weights it holds (exactly the MXFP4 ones), within 5e-3
    where the compiled kernel rounds activations to int8 per 32 inputs (as llama.cpp's
    q8_0 dot products do)."""
    if kernels == "torch":
        monkeypatch.setattr(csrc, "available", lambda: False)
    elif not csrc.available():
        pytest.skip("no compiled CPU kernels")
    bound = 1e-4 if kernels == "torch" else 5e-3
    path, hf = mxfp4_model
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    with LLM(path, kv_cache_memory_gib=0.01, **engine) as llm:
        moe = llm.engine.core.runner.model.model.layers[1].mlp
        assert moe.experts[0].gate_up_proj.kernel.method == "mxfp4"
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, 12)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0], dim=-1)
        for j, entry in enumerate(out.outputs[0].logprobs):
            row = ref[len(prompt) - 1 + j]
            assert max(abs(lp.logprob - row[t].item()) for t, lp in entry.items()) < bound


def test_mxfp4_experts_run_as_one_call_equal_to_the_loop(mxfp4_model):
    """On a VNNI CPU each MoE layer's MXFP4 experts are one compiled call
    (quantization/mxfp4_experts.py), equal to the per-expert loop over the same kernels (to
    float rounding of the activation's sigmoid) for 1 to 9 rows; elsewhere the loop stays."""
    from tokenmill.layers.moe import grouped_experts
    from tokenmill.quantization.mxfp4_experts import Fp4Experts

    with LLM(mxfp4_model[0], kv_cache_memory_gib=0.01) as llm:
        moe = llm.engine.core.runner.model.model.layers[1].mlp
        fp4 = moe.experts[0].gate_up_proj.kernel.fp4
        assert isinstance(moe.fused, Fp4Experts) == (fp4 and csrc.available())
        if moe.fused is None:
            pytest.skip("no AVX-512 VNNI: the experts stay in the per-expert loop")
        gen = torch.Generator().manual_seed(0)
        for rows in (1, 2, 9):
            x = torch.randn(rows, moe.gate.in_features, generator=gen)
            logits = torch.randn(rows, len(moe.experts), generator=gen)
            weights, ids = torch.topk(torch.softmax(logits, -1), moe.top_k)
            fused = moe.fused(x, weights, ids)
            loop = grouped_experts(x, weights, ids, moe.experts)
            torch.testing.assert_close(fused, loop, rtol=1e-4,
                                       atol=1e-4 * loop.abs().max().item())

