"""The compiled decode step (tokenmill/csrc/decode_step.c: every decoder layer in one call)
against the same model run layer by layer from Python, and against transformers."""

import pytest
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams, csrc
from tokenmill.attention.reference import ReferenceBackend
from tokenmill.quantization.linear_kernels import INT4_MAX_ROWS, INT8_MAX_ROWS
from tokenmill.worker.cpu_decode_step import CpuDecodeStep

pytestmark = pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 50)), [7, 8], list(range(300, 333))]


@pytest.fixture
def step_calls(monkeypatch):
    """Counts the steps the compiled decode step ran (returned hidden states for)."""
    calls = {"ran": 0, "declined": 0}
    original = CpuDecodeStep.__call__

    def counting(self, *args):
        hidden = original(self, *args)
        calls["ran" if hidden is not None else "declined"] += 1
        return hidden

    monkeypatch.setattr(CpuDecodeStep, "__call__", counting)
    return calls


def generate(path, prompts, params, **engine_args):
    llm = LLM(path, kv_cache_memory_gib=0.01, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def assert_same_outputs(fused, layered, tolerance=1e-5):
    """Same tokens, same top-logprob tokens, logprobs within `tolerance`."""
    for a, b in zip(fused, layered, strict=True):
        assert a.token_ids == b.token_ids
        for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for token in pa:
                assert abs(pa[token].logprob - pb[token].logprob) < tolerance


@pytest.mark.parametrize("arch,quantization,kv_cache_dtype,vnni", [
    ("llama", None, "auto", None), ("qwen2", None, "auto", None), ("qwen3", None, "auto", None),
    ("llama3", None, "int8", None), ("llama3", None, "bfloat16", None),
    # both weight layouts of int8 / int4, whichever this CPU picks (the VNNI panels have a
    # portable build with the same results)
    ("llama", "int8", "auto", True), ("llama", "int8", "auto", False),
    ("qwen2", "int4", "int8", True), ("qwen2", "int4", "int8", False),
    # mixtures of experts: routing, the active experts and the shared expert in C
    ("mixtral", None, "auto", None), ("qwen2_moe", None, "auto", None),
    ("qwen3_moe", "int8", "auto", True), ("qwen2_moe", "int4", "auto", False),
])
def test_compiled_step_equals_layer_by_layer(tiny_models, monkeypatch, step_calls, arch,
                                             quantization, kv_cache_dtype, vnni):
    if vnni is not None:
        monkeypatch.setattr(csrc, "vnni_native", lambda: vnni)
    path, _ = tiny_models(arch)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    args = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    llm, fused = generate(path, PROMPTS, params, **args)
    step = llm.engine.core.runner.decode_step
    # the step takes as many rows as its layers' compiled kernels are the fastest for
    limit = 64 if vnni or quantization is None else {"int8": INT8_MAX_ROWS,
                                                      "int4": INT4_MAX_ROWS}[quantization]
    assert step is not None and step.max_rows == min(64, limit)
    assert step_calls["ran"] >= 9  # every decode step of the batch (4 rows)
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")
    llm, layered = generate(path, PROMPTS, params, **args)
    assert llm.engine.core.runner.decode_step is None
    # The router's softmax takes C's expf, not torch's vectorized exp: routing weights within
    # an ulp, which int16-rounded activations (int8 / int4 kernels) turn into ~1e-4 by the
    # last tokens.
    moe = arch in ("mixtral", "qwen2_moe", "qwen3_moe")
    assert_same_outputs(fused, layered, (1e-3 if quantization else 1e-4) if moe else 1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_moe"])
def test_compiled_step_with_bf16_weights_equals_layer_by_layer(tiny_models, monkeypatch,
                                                               step_calls, arch):
    """--dtype bfloat16 on the CPU (bf16 weight panels, float32 activations) runs compiled,
    the gate|up product fused, and equals its layer-by-layer run."""
    path, _ = tiny_models(arch)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    llm, fused = generate(path, PROMPTS, params, dtype="bfloat16")
    step = llm.engine.core.runner.decode_step
    assert step is not None and step.max_rows == 64 and step_calls["ran"] >= 9
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")
    llm, layered = generate(path, PROMPTS, params, dtype="bfloat16")
    assert llm.engine.core.runner.decode_step is None
    assert_same_outputs(fused, layered, 1e-4 if arch == "qwen2_moe" else 1e-5)


def test_batches_above_the_row_limit_fall_back_and_match_transformers(tiny_models,
                                                                      step_calls):
    """70 sequences finishing at different lengths: steps with more than 64 decodes run
    layer by layer, the rest compiled; every sequence equals transformers' greedy output."""
    path, hf = tiny_models("llama")
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + i % 9)] for i in range(70)]
    lengths = [2 + i % 12 for i in range(70)]
    llm = LLM(path, kv_cache_memory_gib=0.01)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                         for n in lengths], use_tqdm=False)
    assert llm.engine.core.runner.decode_step.max_rows == 64
    # declined: the prompt step and the one step of 70 decodes (then 6 sequences are done)
    assert step_calls["ran"] > 0 and step_calls["declined"] == 2
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, n)


def test_quantized_batches_of_many_rows_run_compiled(tiny_models, monkeypatch, step_calls):
    """int8 weights: steps of 20 decodes run compiled and equal the layer-by-layer run."""
    path, _ = tiny_models("llama")
    prompts = [[(5 * i + j) % 250 + 3 for j in range(4 + i)] for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    _, fused = generate(path, prompts, params, quantization="int8")
    assert step_calls == {"ran": 4, "declined": 1}  # the one prompt step is not a decode
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")
    _, layered = generate(path, prompts, params, quantization="int8")
    assert_same_outputs(fused, layered)


def test_build_declines_what_it_cannot_run(tiny_models, monkeypatch):
    path, _ = tiny_models("llama")
    llm = LLM(path, kv_cache_memory_gib=0.01)
    model, runner = llm.engine.core.runner.model, llm.engine.core.runner
    assert CpuDecodeStep.build(model, runner.backend) is not None
    assert CpuDecodeStep.build(model, ReferenceBackend()) is None
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")
    assert CpuDecodeStep.build(model, runner.backend) is None
    monkeypatch.delenv("TOKENMILL_CPU_DECODE_STEP")
    # one epsilon serves every norm in C: a q/k head norm with its own is declined
    qwen3 = LLM(tiny_models("qwen3")[0], kv_cache_memory_gib=0.01).engine.core.runner
    qwen3.model.model.layers[1].self_attn.k_norm.eps = 1e-3
    assert CpuDecodeStep.build(qwen3.model, qwen3.backend) is None
    # a8w8 layers (fbgemm) have no compiled form: the whole step stays in Python
    llm = LLM(path, kv_cache_memory_gib=0.01, quantization="a8w8")
    assert llm.engine.core.runner.decode_step is None


def test_rebound_caches_are_not_written_through_stale_addresses(tiny_models, step_calls):
    path, hf = tiny_models("llama")
    llm = LLM(path, kv_cache_memory_gib=0.01)
    runner = llm.engine.core.runner
    for layer in runner.model.attention_layers():
        layer.k_cache, layer.v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    assert step_calls["ran"] == 0 and step_calls["declined"] > 0
    assert out.outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 6)
