"""Adapters on the token embedding and the LM head (PEFT's lora_embedding_A/B and an
lm_head pair): greedy tokens and prompt logprobs as transformers + peft's, mixed in one batch
with another adapter and the base model, on a tied and an untied model; PEFT's saved copy of
the base layer served only where it is the base model's own."""

import os
import shutil

import pytest
import torch
from helpers import hf_greedy
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

PROMPTS = [[5, 9, 23, 41, 7, 3], [11, 12, 13], [100, 3, 77, 2, 9, 9, 31, 8, 60]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
VOCAB = ["embed_tokens", "lm_head", "q_proj"]


def _peft_prompt_logprobs(model, prompt):
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # (untied; tied embeddings)
def test_embedding_and_head_match_peft(tiny_models, adapters, arch):
    path, hf_model = tiny_models(arch)
    a_path, a_ref = adapters(arch, "vocab-a", seed=21, target_modules=VOCAB)
    b_path, b_ref = adapters(arch, "vocab-b", seed=22, r=4, target_modules=["v_proj"])
    a, b = LoRARequest("a", 1, a_path), LoRARequest("b", 2, b_path)
    assert [hf_greedy(a_ref, p, 8) for p in PROMPTS] != [hf_greedy(hf_model, p, 8)
                                                         for p in PROMPTS]
    plan = [(p, lora, ref) for p in PROMPTS
            for lora, ref in ((a, a_ref), (None, hf_model), (b, b_ref))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(path, enable_lora=True, max_loras=2, max_model_len=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in plan], params,
                            use_tqdm=False, lora_request=[lora for _, lora, _ in plan])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 8)
                                                      for p, _, ref in plan]
    for out, (prompt, _, ref) in zip(outs, plan):
        got = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        assert got == pytest.approx(_peft_prompt_logprobs(ref, prompt), abs=1e-4)


def test_saved_base_copy_checked(tiny_models, adapters, tmp_path):
    """PEFT stores a targeted embedding's whole base weight beside its pair: a copy that is
    not this base model's (a trained or resized vocabulary) is refused by name."""
    path, _ = tiny_models("llama")
    a_path, _ = adapters("llama", "vocab-a", seed=21, target_modules=VOCAB)
    weights = load_file(os.path.join(a_path, "adapter_model.safetensors"))
    key = "base_model.model.model.embed_tokens.base_layer.weight"
    assert key in weights  # (PEFT's default when it targets an embedding)
    changed = str(tmp_path / "changed")
    shutil.copytree(a_path, changed)
    weights[key] = weights[key].clone()
    weights[key][3, 0] += 1.0
    save_file(weights, os.path.join(changed, "adapter_model.safetensors"))
    resized = str(tmp_path / "resized")
    shutil.copytree(a_path, resized)
    weights[key] = torch.cat([weights[key], weights[key][:2]])
    save_file(weights, os.path.join(resized, "adapter_model.safetensors"))
    with LLM(path, enable_lora=True, max_model_len=128) as llm:
        for name, folder, message in (("changed", changed, "not this base model's"),
                                      ("resized", resized, "a resized vocabulary")):
            with pytest.raises(ValueError) as err:
                llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                             lora_request=LoRARequest(name, 5, folder))
            text = str(err.value)
            assert message in text and "'model.embed_tokens'" in text and "\n" not in text
