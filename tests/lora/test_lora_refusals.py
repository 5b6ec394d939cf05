"""Bad adapters: one-line errors naming what is wrong, nothing loaded, the engine and the
adapters already held unaffected."""

import json
import os
import shutil

import pytest
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 9, 23, 41]}


def _edited(src: str, dst: str, **config) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        data = json.load(f)
    data.update(config)
    with open(path, "w") as f:
        json.dump(data, f)
    return dst


@pytest.fixture(scope="module")
def llm(tiny_models):
    with LLM(tiny_models("llama")[0], enable_lora=True, max_lora_rank=16,
             max_model_len=128) as llm:
        yield llm


def test_refusals(llm, tiny_models, adapters, tmp_path):
    good_path, good_ref = adapters("llama", "refusal-good", seed=3,
                                   target_modules=["q_proj", "v_proj"])
    big_path, _ = adapters("llama", "refusal-r32", seed=4, r=32, target_modules=["q_proj"])
    other_path, _ = adapters("qwen3", "refusal-qwen3", seed=5, target_modules=["q_proj"])
    truncated = str(tmp_path / "truncated")
    shutil.copytree(good_path, truncated)
    weights = os.path.join(truncated, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    cases = {
        str(tmp_path / "missing"): "no adapter_config.json",
        big_path: "rank 32 is above --max-lora-rank (16)",
        other_path: "do not fit the base layer",
        truncated: "adapter_model.safetensors",
        _edited(good_path, str(tmp_path / "dora"), use_dora=True): "DoRA (use_dora)",
        _edited(good_path, str(tmp_path / "saved"), modules_to_save=["lm_head"]):
            "modules_to_save",
        _edited(good_path, str(tmp_path / "bias"), bias="all"): "bias='all'",
    }
    for i, (path, message) in enumerate(cases.items()):
        with pytest.raises(ValueError) as err:
            llm.generate([PROMPT], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(f"bad{i}", 10 + i, path))
        text = str(err.value)
        assert message in text and "\n" not in text and f"'bad{i}'" in text, text
    assert llm.engine.core.runner.lora.list() == []  # (nothing loaded)
    # the engine still serves, adapters and the base model alike
    good = LoRARequest("good", 1, good_path)
    out = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[good, None])
    assert out[0].outputs[0].token_ids == hf_greedy(good_ref, PROMPT["prompt_token_ids"], 4)
    assert out[1].outputs[0].token_ids == hf_greedy(tiny_models("llama")[1],
                                                    PROMPT["prompt_token_ids"], 4)


def test_lora_request_without_enable_lora(tiny_models, adapters):
    path, _ = adapters("llama", "refusal-good", seed=3, target_modules=["q_proj", "v_proj"])
    with LLM(tiny_models("llama")[0], max_model_len=128) as llm, \
            pytest.raises(ValueError, match="--enable-lora"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, path))


@pytest.mark.parametrize("args,message", [
    (("", 1, "x"), "lora_name"), (("a", 0, "x"), "lora_int_id"),
    (("a", True, "x"), "lora_int_id"),
])
def test_lora_request_checked(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


def test_adapter_on_experts_is_refused(tiny_models, tmp_path):
    """An expert's projection (Mixtral's checkpoint names, written by hand: peft targets fused
    experts through target_parameters, refused by name too)."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "experts"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["w1"]}))
    key = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"
    save_file({f"{key}.lora_A.weight": torch.zeros(4, 64),
               f"{key}.lora_B.weight": torch.zeros(128, 4)},
              str(folder / "adapter_model.safetensors"))
    with LLM(tiny_models("mixtral")[0], enable_lora=True, max_model_len=128) as llm, \
            pytest.raises(ValueError, match="experts, routers and latent attention"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("e", 1, str(folder)))
