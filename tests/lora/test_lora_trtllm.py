"""TensorRT-LLM's adapter tensors (lora_weights / lora_config, as its hf_lora_convert.py
writes them) saved as a folder and served: greedy tokens as transformers + peft on the PEFT
adapter they came from, a fused attn_qkv module included; malformed tensors refused in one
line naming the cause. (Sent with a request over Triton generate and gRPC:
test_lora_routes.py.)"""

import os

import numpy as np
import pytest
from helpers import hf_greedy

from tests.lora.trtllm_convert import trtllm_tensors
from tokenmill import LLM, SamplingParams
from tokenmill.lora import trtllm_format
from tokenmill.lora.request import LoRARequest

PROMPTS = [[5, 9, 23, 41, 7, 3], [100, 3, 77, 2, 9]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_trtllm_folder_matches_peft(tiny_models, adapters, tmp_path):
    path, hf_model = tiny_models("llama")
    adapter_path, reference = adapters("llama", "trtllm", seed=31, target_modules=TARGETS)
    weights, config = trtllm_tensors(adapter_path, fuse_qkv_layers=[0])
    assert 0 in config[:, 0]  # (layer 0's q, k, v as one attn_qkv module of rank 3r)
    trtllm_format.write_folder(*trtllm_format.checked(weights, config), str(tmp_path / "t"))
    with LLM(path, enable_lora=True, max_lora_rank=32, max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            use_tqdm=False, lora_request=LoRARequest("t", 1, str(tmp_path / "t")))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, 6)
                                                      for p in PROMPTS]
    assert [hf_greedy(reference, p, 6) for p in PROMPTS] != [hf_greedy(hf_model, p, 6)
                                                            for p in PROMPTS]


@pytest.mark.parametrize("change,message", [
    (lambda w, c: (w, c[:, :2]), "lora_config must be integers of shape [rows, 3]"),
    (lambda w, c: (w[:1], c), "lora_weights has 1 rows and lora_config"),
    (lambda w, c: (w, np.vstack([[13, 0, 8], c[1:]])), "module id 13 (moe_h_to_4h)"),
    (lambda w, c: (w, np.vstack([c[:1], c[:1], c[2:]])), "is given twice"),
    (lambda w, c: (w * np.nan, c), "not finite"),
    (lambda w, c: (w, c.astype(np.float32)), "must be integers"),
])
def test_malformed_tensors(tiny_models, adapters, change, message):
    adapter_path, _ = adapters("llama", "trtllm", seed=31, target_modules=TARGETS)
    weights, config = trtllm_tensors(adapter_path)
    with pytest.raises(trtllm_format.TensorsError) as err:
        trtllm_format.checked(*change(weights, config))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_rows_checked_against_the_model(tiny_models, adapters, tmp_path):
    """A row too short for its layer's shape, a layer the model lacks, a rank above
    --max-lora-rank: one line each, nothing loaded."""
    path, _ = tiny_models("llama")
    adapter_path, _ = adapters("llama", "trtllm", seed=31, target_modules=TARGETS)
    weights, config = trtllm_tensors(adapter_path)
    short = weights[:, :weights.shape[1] // 3]
    far = config.copy()
    far[0, 1] = 99
    big = config.copy()
    big[:, 2] = 64
    cases = {"short": (short, config, "holds"), "far": (weights, far, "layer 99 is not"),
             "big": (np.pad(weights, ((0, 0), (0, 64 * 400))), big, "above --max-lora-rank")}
    with LLM(path, enable_lora=True, max_model_len=128) as llm:
        for name, (w, c, message) in cases.items():
            trtllm_format.write_folder(*trtllm_format.checked(w, c), str(tmp_path / name))
            with pytest.raises(ValueError) as err:
                llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                             lora_request=LoRARequest(name, 3, str(tmp_path / name)))
            assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert llm.engine.core.runner.lora.list() == []


def test_folder_written_for_a_request_goes_with_its_adapter(tiny_models, adapters, tmp_path):
    """A folder the server wrote from a request's tensors is deleted once its adapter is
    unloaded and no request uses it; a user's folder never is."""
    from tokenmill.entrypoints.api import lora_tensors

    path, _ = tiny_models("llama")
    adapter_path, _ = adapters("llama", "trtllm", seed=31, target_modules=TARGETS)
    written, users = str(tmp_path / "written"), str(tmp_path / "users")
    lora_tensors._write(*trtllm_format.checked(*trtllm_tensors(adapter_path)), written)
    trtllm_format.write_folder(*trtllm_format.checked(*trtllm_tensors(adapter_path)), users)
    with LLM(path, enable_lora=True, max_model_len=128) as llm:
        core = llm.engine.core
        for name, folder in (("written", written), ("users", users)):
            lora = core.load_lora(name, folder)
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                         lora_request=lora)
            core.unload_lora(name)
    assert not os.path.exists(written) and trtllm_format.is_folder(users)


def test_registrations_bounded(monkeypatch):
    """Past MAX_TASK_ADAPTERS the oldest registration is unloaded; one already registered is
    reused (an engine stand-in that records what it is asked)."""
    import asyncio

    from tokenmill.entrypoints.api import lora_tensors
    from tokenmill.lora.request import LoRARequest

    class Engine:
        def __init__(self):
            self.loras, self.asked = {}, []

        async def update_lora(self, name, path=""):
            self.asked.append((name, bool(path)))
            if path:
                self.loras[name] = LoRARequest(name, len(self.asked), path)
            else:
                del self.loras[name]

    class State:
        engine = Engine()

        @property
        def adapters(self):
            return self.engine.loras

    monkeypatch.setattr(lora_tensors, "MAX_TASK_ADAPTERS", 2)
    state, tasks = State(), lora_tensors.TaskAdapters()
    weights, config = np.ones((1, 8 * 200), np.float32), np.array([[1, 0, 8]])

    async def run():
        for task in (5, 6, 5, 7):
            await tasks.register(state, task, weights, config)

    asyncio.run(run())
    assert state.engine.asked == [("trtllm-task-5", True), ("trtllm-task-6", True),
                                  ("trtllm-task-5", False), ("trtllm-task-7", True)]
    assert set(state.adapters) == {"trtllm-task-6", "trtllm-task-7"}
