"""Adapters served offline: greedy tokens equal to transformers + peft on the same base and
adapter, alone and mixed in one batch with other adapters and the base model."""

import pytest
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

PROMPTS = [[5, 9, 23, 41, 7, 3], [11, 12, 13], [100, 3, 77, 2, 9, 9, 31, 8, 60]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch,targets,rank,extra", [
    ("llama", ATTN + MLP, 8, {}),
    ("llama", ["q_proj", "v_proj"], 64, {"lora_alpha": 32}),
    ("qwen2", ATTN + MLP, 16, {"use_rslora": True}),
    ("phi3", ["qkv_proj", "gate_up_proj", "down_proj"], 16, {}),
    ("mixtral", ATTN, 8, {}),  # (a mixture of experts: adapters on its attention)
])
def test_adapter_matches_peft(tiny_models, adapters, arch, targets, rank, extra):
    path, hf_model = tiny_models(arch)
    adapter_path, reference = adapters(arch, f"{rank}-{'-'.join(targets)}", r=rank,
                                       target_modules=targets, **extra)
    expected = [hf_greedy(reference, p, 8) for p in PROMPTS]
    base = [hf_greedy(hf_model, p, 8) for p in PROMPTS]
    assert expected != base  # (the adapter changes what the model says)
    with LLM(path, enable_lora=True, max_lora_rank=64, max_model_len=256) as llm:
        lora = LoRARequest("a", 1, adapter_path)
        got = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                   use_tqdm=False, lora_request=lora))
        plain = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                     use_tqdm=False))
    assert got == expected
    assert plain == base


def test_mixed_batch(tiny_models, adapters):
    """Two adapters and the base model in the same steps, each request as if alone (decode
    steps in the compiled decode step, csrc/lora.c adding the adapters' products)."""
    path, hf_model = tiny_models("llama")
    a_path, a_ref = adapters("llama", "mix-a", seed=1, target_modules=ATTN + MLP)
    b_path, b_ref = adapters("llama", "mix-b", seed=2, r=16, target_modules=["q_proj", "v_proj",
                                                                            "down_proj"])
    a, b = LoRARequest("a", 1, a_path), LoRARequest("b", 2, b_path)
    plan = [(p, lora, ref) for p in PROMPTS
            for lora, ref in ((a, a_ref), (None, hf_model), (b, b_ref))]
    expected = [hf_greedy(ref, p, 8) for p, _, ref in plan]
    with LLM(path, enable_lora=True, max_loras=2, max_model_len=256) as llm:
        step = llm.engine.core.runner.decode_step
        compiled = []
        if step is not None:  # (a CPU with the compiled kernels)
            described = step._step_loras
            step._step_loras = lambda rows: compiled.append(rows) or described(rows)
        got = _tokens(llm.generate([{"prompt_token_ids": p} for p, _, _ in plan], GREEDY,
                                   use_tqdm=False, lora_request=[lora for _, lora, _ in plan]))
    assert got == expected
    assert step is None or len(compiled) >= GREEDY.max_tokens - 1


def test_prefix_cache_keyed_by_adapter(tiny_models, adapters):
    """A prompt's blocks cached under one adapter are not reused under another adapter or
    the base model, and are reused under the same adapter."""
    path, hf_model = tiny_models("llama")
    a_path, a_ref = adapters("llama", "mix-a", seed=1, target_modules=ATTN + MLP)
    b_path, b_ref = adapters("llama", "mix-b", seed=2, r=16, target_modules=["q_proj", "v_proj",
                                                                            "down_proj"])
    prompt = list(range(3, 3 + 40))  # (two full blocks of 16 to cache)
    a, b = LoRARequest("a", 1, a_path), LoRARequest("b", 2, b_path)
    with LLM(path, enable_lora=True, max_loras=2, max_model_len=256) as llm:
        runs = []
        for lora in (a, None, b, a):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False,
                               lora_request=lora)[0]
            runs.append((out.outputs[0].token_ids, out.num_cached_tokens))
    assert [cached for _, cached in runs] == [0, 0, 0, 32]
    assert [tokens for tokens, _ in runs] == [hf_greedy(ref, prompt, 8)
                                              for ref in (a_ref, hf_model, b_ref, a_ref)]


def test_more_adapters_than_slots(tiny_models, adapters):
    """Three adapters through one slot (and host memory for two): requests wait their turn,
    each answered as if alone."""
    path, _ = tiny_models("llama")
    refs = [adapters("llama", f"slot-{i}", seed=10 + i, target_modules=["q_proj", "o_proj"])
            for i in range(3)]
    plan = [(p, i) for p in PROMPTS for i in range(3)]
    expected = [hf_greedy(refs[i][1], p, 8) for p, i in plan]
    with LLM(path, enable_lora=True, max_loras=1, max_cpu_loras=2, max_model_len=256) as llm:
        got = _tokens(llm.generate([{"prompt_token_ids": p} for p, _ in plan], GREEDY,
                                   use_tqdm=False,
                                   lora_request=[LoRARequest(f"s{i}", i + 1, refs[i][0])
                                                 for _, i in plan]))
    assert got == expected


def test_mixed_batch_tensor_parallel(tiny_models, adapters):
    """Tensor parallel 2: A and B cut as their base layers (column-parallel B by rows,
    row-parallel A by columns, the embedding's A and the LM head's B by vocabulary rows),
    the same tokens as peft."""
    path, hf_model = tiny_models("qwen2")
    a_path, a_ref = adapters("qwen2", "tp-a", seed=6, r=16, target_modules=ATTN + MLP)
    b_path, b_ref = adapters("qwen2", "tp-b", seed=7, target_modules=[
        "k_proj", "o_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"])
    a, b = LoRARequest("a", 1, a_path), LoRARequest("b", 2, b_path)
    plan = [(p, lora, ref) for p in PROMPTS
            for lora, ref in ((a, a_ref), (None, hf_model), (b, b_ref))]
    expected = [hf_greedy(ref, p, 8) for p, _, ref in plan]
    with LLM(path, enable_lora=True, max_loras=2, max_model_len=256,
             tensor_parallel_size=2) as llm:
        got = _tokens(llm.generate([{"prompt_token_ids": p} for p, _, _ in plan], GREEDY,
                                   use_tqdm=False, lora_request=[lora for _, lora, _ in plan]))
    assert got == expected
