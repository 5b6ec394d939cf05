"""Adapters with the rest of the engine: a quantized base (against peft over transformers
with the same rounded weights), speculative decoding (n-gram drafts, and a draft model that
runs without adapters while the target verifies with them): greedy tokens as peft's."""

import copy

import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

PROMPTS = [[5, 9, 23, 41, 7, 3], [11, 12, 13, 11, 12, 13, 11, 12], [100, 3, 77, 2, 9, 9, 31]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _run(path, adapter_path, **engine):
    lora = LoRARequest("a", 1, adapter_path)
    with LLM(path, enable_lora=True, max_model_len=256, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


def test_int8_base(tiny_models, adapters, monkeypatch):
    from peft import PeftModel

    from tokenmill.quantization.model import KERNELS

    monkeypatch.setenv("TOKENMILL_CPU_INT_DOT", "0")  # (float activations: exact weight-only)
    path, hf = tiny_models("llama")
    adapter_path, _ = adapters("llama", "with-all", seed=11, target_modules=TARGETS)
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(KERNELS["int8"].from_weight(module.weight).dequantize())
    reference = PeftModel.from_pretrained(rounded, adapter_path).eval()
    assert _run(path, adapter_path, quantization="int8") == [hf_greedy(reference, p, 12)
                                                             for p in PROMPTS]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
     "prompt_lookup_max": 3},
    {"quantization": "int4", "num_speculative_tokens": 3},  # (a self-draft, no adapters)
])
def test_speculative_decoding(tiny_models, adapters, spec):
    path, _ = tiny_models("llama")
    adapter_path, reference = adapters("llama", "with-all", seed=11, target_modules=TARGETS)
    assert _run(path, adapter_path, speculative_config=spec) == [
        hf_greedy(reference, p, 12) for p in PROMPTS]


def test_graph_buckets_run_base_steps_only(tiny_models, adapters, monkeypatch):
    """Decode graphs and piecewise graphs (run eagerly on the CPU) hold the base model: steps
    with adapters run outside them, base-only steps in them, every answer as peft's."""
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    path, hf = tiny_models("llama")
    adapter_path, reference = adapters("llama", "with-all", seed=11, target_modules=TARGETS)
    lora = LoRARequest("a", 1, adapter_path)
    with LLM(path, enable_lora=True, max_model_len=256, attention_backend="triton",
             max_num_seqs=4, max_num_batched_tokens=24) as llm:
        graphs = llm.engine.core.runner.graphs
        ran = []
        run = graphs.run
        monkeypatch.setattr(graphs, "run", lambda inputs, fill=None: ran.append(
            bool(inputs.lora_ids)) or run(inputs, fill))
        got = {}
        for name, request in (("base", None), ("lora", lora)):
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                use_tqdm=False, lora_request=request)
            got[name] = [o.outputs[0].token_ids for o in outs]
    assert got["base"] == [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert got["lora"] == [hf_greedy(reference, p, 12) for p in PROMPTS]
    assert ran and not any(ran)  # (base steps in graphs; none with an adapter)
