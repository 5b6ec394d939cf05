"""Adapters with the rest of the engine: a quantized base (against peft over transformers
with the same rounded weights), GGUF bases (f32 and q8_0, against peft over transformers'
reading of the file), speculative decoding (n-gram drafts, and a draft model that runs
without adapters while the target verifies with them), structured outputs (against the
merged model): greedy tokens as the reference's."""

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


def test_structured_outputs(tiny_models, adapters, tmp_path):
    """Constrained requests (a regex, a JSON schema) with an adapter: valid, and the tokens
    the same constraints give on the merged model (peft's merge_and_unload, served without
    adapters)."""
    import json
    import re
    import shutil

    path, _ = tiny_models("llama")
    adapter_path, reference = adapters("llama", "with-all", seed=11, target_modules=TARGETS)
    merged = str(tmp_path / "merged")
    shutil.copytree(path, merged)  # (the tokenizer's files; the weights replaced below)
    copy.deepcopy(reference).merge_and_unload().save_pretrained(merged)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=60,
                             structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": schema})]
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * 2
    with LLM(path, enable_lora=True, max_model_len=256) as llm:
        got = llm.generate(prompts, params, use_tqdm=False,
                           lora_request=LoRARequest("a", 1, adapter_path))
        base = llm.generate(prompts, params, use_tqdm=False)
    with LLM(merged, max_model_len=256) as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in base]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", got[0].outputs[0].text)
    assert set(json.loads(got[1].outputs[0].text)) == {"n"}


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_gguf_base(tiny_models, adapters, tmp_path, outtype):
    """A GGUF base (written by `tokenmill convert`: q and k rows permuted for llama.cpp's
    rotary, undone on load) with a PEFT adapter: tokens as peft over transformers' reading of
    the same file (f32: the source model itself)."""
    import subprocess
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, hf = tiny_models("llama")
    adapter_path, reference = adapters("llama", "with-all", seed=11, target_modules=TARGETS)
    gguf = str(tmp_path / f"m-{outtype}.gguf")
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "convert", path,
                           gguf, "--outtype", outtype], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    if outtype != "f32":
        pytest.importorskip("accelerate")
        read = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf,
                                                    torch_dtype=torch.float32)
        reference = PeftModel.from_pretrained(read, adapter_path).eval()
    assert _run(gguf, adapter_path) == [hf_greedy(reference, p, 12) for p in PROMPTS]
