"""Quantized models end to end on tiny checkpoints: quantize at load, int8 KV cache, GGUF
blocks served as they are, memory as theory says, `tokenmill quantize` save -> load."""

import copy
import json

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from helpers import hf_greedy, write_calibration

from tokenmill import LLM, SamplingParams, csrc
from tokenmill.entrypoints.cli import main as cli
from tokenmill.quantization.model import weight_bytes

PROMPTS = [[5, 9, 23, 7, 81, 44, 3, 12, 60, 19, 2, 33],
           [100, 101, 102, 7, 8, 9, 250, 300, 11, 4, 77, 45, 46, 47, 48, 49, 50, 51]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)


def run(path, **kwargs):
    llm = LLM(path, kv_cache_memory_gib=0.01, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    # logprob of each actual prompt token (position 0 has none)
    logprobs = [np.array([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
                for o in outs]
    return llm, [o.outputs[0].token_ids for o in outs], logprobs


def max_logprob_gap(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def mean_logprob_gap(a, b):
    return float(np.concatenate([np.abs(x - y) for x, y in zip(a, b)]).mean())


def hf_prompt_logprobs(model):
    with torch.no_grad():
        out = []
        for p in PROMPTS:
            logits = model(torch.tensor([p])).logits[0].float()
            out.append(torch.log_softmax(logits, -1)[:-1].gather(
                1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1).numpy())
        return out


@pytest.fixture(scope="module")
def baseline(tiny_models):
    path = tiny_models("llama")[0]
    return path, run(path)


# Mean move of the prompt logprobs (around -7 on the tiny random model, whose large random
# weights make it far more sensitive than a trained one) allowed per method; measured about
# a third of these. Weight-only methods are also checked exactly against transformers.
TOLERANCE = {"int8": 0.1, "int4": 1.5, "a8w8": 0.4, "fp8": 0.5}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_weight_only_matches_transformers_with_the_same_rounded_weights(tiny_models, method,
                                                                      monkeypatch):
    from tokenmill.quantization.model import KERNELS

    # float activations: the exact weight-only arithmetic (int8 activations: test_kernels.py)
    monkeypatch.setenv("TOKENMILL_CPU_INT_DOT", "0")
    path, hf = tiny_models("llama")
    llm, tokens, logprobs = run(path, quantization=method)
    reference = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear):
                # int4 keeps the LM head at int8 (QuantConfig.layer_method)
                kind = "int8" if name == "lm_head" else method
                module.weight.copy_(KERNELS[kind].from_weight(module.weight).dequantize())
    assert max_logprob_gap(logprobs, hf_prompt_logprobs(reference)) < 2e-3
    model = llm.engine.core.runner.model
    assert {type(m.kernel).__name__ for n, m in model.named_modules()
            if hasattr(m, "kernel") and n != "lm_head"} == {f"{method.capitalize()}Kernel"}
    assert type(model.lm_head.kernel).__name__ == "Int8Kernel"


@pytest.mark.parametrize("method", ["int8", "int4", "a8w8", "fp8"])
def test_quantized_at_load_stays_close_to_float(baseline, method):
    path, (_, tokens, logprobs) = baseline
    llm, q_tokens, q_logprobs = run(path, quantization=method)
    assert mean_logprob_gap(logprobs, q_logprobs) < TOLERANCE[method]


def test_seed_method_names_are_accepted(baseline):
    path = baseline[0]
    llm = LLM(path, kv_cache_memory_gib=0.01, quantization="weight_only_int8")
    assert llm.engine.config.quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(path, quantization="int3")


def test_weight_bytes_match_theory(baseline, tiny_models):
    path, hf = tiny_models("llama")
    linears = [m for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)]
    others = sum(p.numel() for n, p in hf.named_parameters()
                 if not any(p is m.weight for m in linears)) * 4
    n_k = [(m.out_features, m.in_features) for m in linears]
    head = n_k.pop()  # lm_head, the last linear: int8 under both methods
    assert head == (hf.config.vocab_size, hf.config.hidden_size)
    int8_head = head[0] * head[1] + 4 * head[0]
    expected = {
        "int8": others + int8_head + sum(n * k + n * 4 for n, k in n_k),  # + f32 scale per row
        "int4": others + int8_head + sum(n * k // 2 + 2 * 2 * n * k // 32 for n, k in n_k),
    }
    for method, nbytes in expected.items():
        llm = LLM(path, kv_cache_memory_gib=0.01, quantization=method)
        assert weight_bytes(llm.engine.core.runner.model) == nbytes


def test_int8_kv_cache_holds_the_theoretical_block_count_and_stays_close(baseline):
    path, (fp_llm, tokens, logprobs) = baseline
    # Chunked prefill: later chunks attend over K/V already written to (and read from) int8.
    llm, q_tokens, q_logprobs = run(path, kv_cache_dtype="int8", max_num_batched_tokens=4)
    fp_runner, runner = fp_llm.engine.core.runner, llm.engine.core.runner
    attn = runner.model.attention_layers()[0]
    assert runner.kv_dtype == torch.int8 and attn.k_cache.dtype == torch.int8
    layers, block = runner.num_layers, runner.block_size
    assert runner.block_bytes == 2 * layers * block * attn.num_kv_heads * (attn.head_dim + 4)
    assert fp_runner.block_bytes == 2 * layers * block * attn.num_kv_heads * attn.head_dim * 4
    budget = int(0.01 * 2**30)
    assert (fp_runner.num_blocks, runner.num_blocks) == (budget // fp_runner.block_bytes,
                                                         budget // runner.block_bytes)
    assert runner.num_blocks > 3 * fp_runner.num_blocks
    assert mean_logprob_gap(logprobs, q_logprobs) < 0.05  # measured 0.015


def test_seed_checkpoints_marking_int8_kv_get_it(tmp_path, tiny_models):
    import shutil

    path = str(tmp_path / "model")
    shutil.copytree(tiny_models("llama")[0], path)
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config["infer_model_cachekv_int8_type"] = "cachekv_int8"  # the seed 3.0 key
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    assert LLM(path, kv_cache_memory_gib=0.01).engine.core.runner.kv_dtype == torch.int8


def test_int8_kv_attention_matches_the_reference_backend():
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.reference import ReferenceBackend
    from tokenmill.attention.torch_sdpa import TorchSDPABackend
    from tokenmill.quantization.kv_cache import dequantize_kv, quantize_kv

    torch.manual_seed(0)
    x = torch.randn(6, 2, 16)
    assert ((dequantize_kv(quantize_kv(x), torch.float32) - x).abs()
            <= x.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()
    # Two sequences: one decoding with 9 cached tokens, one prompt chunk after 5 cached.
    bs, hq, hkv, d = 4, 4, 2, 16
    results = []
    for backend in (ReferenceBackend(), TorchSDPABackend()):
        torch.manual_seed(1)
        k_cache = torch.zeros(8, bs, hkv, d + 4, dtype=torch.int8)
        v_cache = torch.zeros_like(k_cache)
        backend.write_kv(torch.randn(14, hkv, d), torch.randn(14, hkv, d), k_cache, v_cache,
                         torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 18, 19, 20]))
        meta = AttentionMetadata(slot_mapping=torch.tensor([9, 21, 22, 23]),
                                 query_start_loc=[0, 1, 4], context_lens=[9, 5],
                                 seq_lens=torch.tensor([10, 8]),
                                 block_table=torch.tensor([[0, 1, 2], [4, 5, 0]]),
                                 num_decodes=1, block_size=bs)
        backend.prepare(meta)
        q, k, v = torch.randn(4, hq, d), torch.randn(4, hkv, d), torch.randn(4, hkv, d)
        results.append(backend.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5))
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")
@pytest.mark.parametrize("qtype,method", [("Q8_0", "int8"), ("Q4_1", "int4"),
                                          ("Q4_0", "int4")])
@pytest.mark.parametrize("int_dot", [False, True])
def test_gguf_blocks_are_served_without_expanding(tmp_path, tiny_models, qtype, method,
                                                  int_dot, monkeypatch):
    from gguf import GGMLQuantizationType

    from tokenmill.convert.gguf_writer import write_gguf
    from tokenmill.loading import gguf as gguf_loader

    hf_path, hf = tiny_models("llama")
    path = str(tmp_path / f"{qtype}.gguf")
    write_gguf(path, "llama", hf.state_dict(), hf.config, GGMLQuantizationType[qtype])
    gguf_loader._reader.cache_clear()
    monkeypatch.setenv("TOKENMILL_CPU_INT_DOT", str(int(int_dot)))
    llm, tokens, logprobs = run(path, tokenizer=hf_path)
    kernels = {m.kernel.name for m in llm.engine.core.runner.model.modules()
               if hasattr(m, "kernel")}
    vnni = int_dot and csrc.vnni_native()  # VNNI CPUs keep the weights in vnni_panels.c's layout
    assert kernels == {f"{method}-cpu" + ("-vnni" if vnni else "-intdot" if int_dot else "")}
    # The same file with every block expanded to float32 gives the same numbers (integer dot
    # products: activations rounded to 16 bits, within the same bound).
    monkeypatch.setattr(csrc, "available", lambda: False)
    _, fp_tokens, fp_logprobs = run(path, tokenizer=hf_path)
    assert tokens == fp_tokens
    assert max_logprob_gap(logprobs, fp_logprobs) < 1e-3


@pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")
def test_gguf_layer_with_some_projections_kept_quantized(tmp_path, tiny_models):
    """q and k stored as Q4_1 (int4 groups), v as Q8_0 (int8): the merged q|k|v layer, whose
    parts differ in format, is served in float, not as one part's rows alone (which made a
    Qwen2 Q4_K_M file's K projection come out a fraction of its width); the MLP's Q5_0 gate
    and up are served as they are stored."""
    from gguf import GGMLQuantizationType as Q

    from tokenmill.convert.gguf_writer import write_gguf
    from tokenmill.loading import gguf as gguf_loader

    hf_path, hf = tiny_models("qwen2")
    path = str(tmp_path / "mixed.gguf")
    kinds = {"attn_q.weight": Q.Q4_1, "attn_k.weight": Q.Q4_1, "attn_v.weight": Q.Q8_0,
             "ffn_gate.weight": Q.Q5_0, "ffn_up.weight": Q.Q5_0}
    write_gguf(path, "qwen2", hf.state_dict(), hf.config,
               lambda name: kinds.get(name.split(".", 2)[-1]))
    gguf_loader._reader.cache_clear()
    llm, tokens, logprobs = run(path, tokenizer=hf_path)
    layer = llm.engine.core.runner.model.model.layers[0]
    assert not layer.self_attn.qkv_proj.kernel.name.startswith("int")
    assert layer.mlp.gate_up_proj.kernel.name.startswith("q5_0")
    expanded = copy.deepcopy(hf)  # the same rounded weights, in float
    with torch.no_grad():
        for name, param in expanded.named_parameters():
            leaf = gguf_leaf(name)
            if leaf in kinds:
                param.copy_(torch.from_numpy(dequantize(quantize(param.numpy(), kinds[leaf]),
                                                        kinds[leaf])))
    assert tokens == [hf_greedy(expanded, p, PARAMS.max_tokens) for p in PROMPTS]


def gguf_leaf(hf_name: str) -> str:
    from tokenmill.convert.gguf_writer import LAYER_MAP

    return LAYER_MAP.get(hf_name.split(".", 3)[-1], "")


@pytest.mark.parametrize("method,extra", [
    ("int8", []), ("int4", ["--group-size", "64"]), ("a8w8", []), ("fp8", ["--per-tensor"]),
    ("a8w8", ["--activation", "static", "--calib-data", "CALIB"]),
    ("fp8", ["--activation", "static", "--calib-data", "CALIB", "--calib-samples", "2"]),
])
def test_quantize_tool_round_trip(tmp_path, tiny_models, baseline, method, extra, capsys):
    src = tiny_models("qwen2")[0]  # QKV biases: they must survive the round trip too
    out = str(tmp_path / "out")
    extra = [write_calibration(tmp_path) if a == "CALIB" else a for a in extra]
    assert cli(["quantize", "--model", src, "--out", out, "--method", method, *extra]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["method"] == method and report["calibrated"] == ("--calib-data" in extra)
    with open(f"{out}/config.json") as f:
        config = json.load(f)["quantization_config"]
    assert config["quant_method"] == "tokenmill" and config["method"] == method
    with open(f"{out}/generation_config.json") as f, open(f"{src}/generation_config.json") as g:
        assert json.load(f) == json.load(g)  # (its EOS ids and sampling defaults kept)
    _, tokens, logprobs = run(out)
    _, fp_tokens, fp_logprobs = run(src)
    assert mean_logprob_gap(logprobs, fp_logprobs) < TOLERANCE[method]
    if not extra:
        # Default options and no calibration: quantizing at load time is the same computation.
        _, load_tokens, load_logprobs = run(src, quantization=method)
        assert load_tokens == tokens and max_logprob_gap(load_logprobs, logprobs) < 1e-5
    with pytest.raises(ValueError, match="already quantized"):
        LLM(out, quantization="int4" if method != "int4" else "int8")


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "qwen3_next", "mamba2"])
def test_quantized_checkpoints_of_other_families_serve_as_quantizing_at_load(tmp_path,
                                                                           tiny_models, arch):
    """(1 + w) norms (Gemma, Qwen3-Next) are stored as the checkpoint's w (they were stored
    as 1 + w and read back as 2 + w); state layers' convolutions and vectors stay float."""
    src = tiny_models(arch)[0]
    out = str(tmp_path / "out")
    assert cli(["quantize", "--model", src, "--out", out, "--method", "int8"]) == 0
    llm, tokens, logprobs = run(out)
    llm.shutdown()
    llm, load_tokens, load_logprobs = run(src, quantization="int8")
    llm.shutdown()
    assert load_tokens == tokens and max_logprob_gap(load_logprobs, logprobs) < 1e-5


def test_quantize_tool_errors_are_clear(tmp_path, tiny_models, capsys):
    src = tiny_models("llama")[0]
    assert cli(["quantize", "--model", src, "--out", str(tmp_path / "x"),
                "--method", "int3"]) == 2
    assert "Unknown quantization method 'int3'" in capsys.readouterr().err
    assert cli(["quantize", "--model", src, "--out", str(tmp_path / "x"), "--method", "a8w8",
                "--activation", "static"]) == 2
    assert "need --calib-data" in capsys.readouterr().err
    assert cli(["quantize", "--model", src, "--out", str(tmp_path / "x"), "--method", "int4",
                "--group-size", "128"]) == 2  # hidden size 64
    assert "does not divide the input size 64" in capsys.readouterr().err
