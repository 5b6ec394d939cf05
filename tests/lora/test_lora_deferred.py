"""The engine-core process reads a request's adapter on a thread of its own: the other
requests' steps go on meanwhile, the waiting request runs once it is read (as peft answers),
and a bad adapter finishes its request with the error instead of raising."""

import threading

from helpers import hf_greedy

from tokenmill.config.engine import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.protocol import EngineCoreRequest
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

PROMPT = [5, 9, 23, 41, 7, 3]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _step_until(core, outputs, done, limit=500):
    for _ in range(limit):  # (bounded: a few steps a request)
        for out in core.step():
            tokens, _ = outputs.get(out.request_id, ([], None))
            outputs[out.request_id] = (tokens + out.new_token_ids,
                                       out.error if out.error else out.finish_reason)
        if done():
            return
    raise AssertionError(f"not done after {limit} steps: {outputs}")


def _gated_core(path, **config):
    """An engine core reading adapters off its loop (as in its process), each read held
    until the returned event is set."""
    core = EngineCore(EngineConfig(model=path, enable_lora=True, kv_cache_memory_gib=0.02,
                                   max_model_len=256, **config), path)
    core.defer_lora_reads = True
    gate = threading.Event()
    manager = core.loras.manager
    read = manager.read
    manager.read = lambda request: (gate.wait(120), read(request))[1]
    return core, gate


def test_an_adapter_read_holds_up_no_other_request(tiny_models, adapters, tmp_path):
    path, hf = tiny_models("llama")
    adapter_path, reference = adapters("llama", "deferred", seed=14,
                                       target_modules=["q_proj", "v_proj", "down_proj"])
    core, gate = _gated_core(path)
    try:
        core.add_request(EngineCoreRequest("lora", PROMPT, PARAMS,
                                           lora_request=LoRARequest("a", 1, adapter_path)))
        core.add_request(EngineCoreRequest("bad", PROMPT, PARAMS, lora_request=LoRARequest(
            "missing", 2, str(tmp_path / "nowhere"))))
        core.add_request(EngineCoreRequest("base", PROMPT, PARAMS))
        outputs = {}
        _step_until(core, outputs, lambda: outputs.get("base", (0, None))[1] is not None)
        assert "lora" not in outputs  # (still waiting for its read: not one token yet)
        gate.set()
        _step_until(core, outputs, lambda: not core.has_unfinished_requests())
        assert outputs["base"][0] == hf_greedy(hf, PROMPT, 8)
        assert outputs["lora"][0] == hf_greedy(reference, PROMPT, 8)
        assert outputs["bad"][0] == [] and "no adapter_config.json" in outputs["bad"][1]
    finally:
        gate.set()
        core.shutdown()


def test_other_ranks_read_ahead(tiny_models, adapters, monkeypatch):
    """Tensor parallel 2: an adapter rank 0 reads off its loop is announced in the next
    step's inputs, before any step runs its request, and the answers are peft's."""
    from tokenmill.worker import model_runner
    from tokenmill.worker.step_inputs import StepInputs

    path, hf = tiny_models("llama")
    adapter_path, reference = adapters("llama", "deferred", seed=14,
                                       target_modules=["q_proj", "v_proj", "down_proj"])
    steps = []
    made = StepInputs.of
    monkeypatch.setattr(model_runner.StepInputs, "of", lambda scheduled, *rest: (
        steps.append(made(scheduled, *rest)) or steps[-1]))
    core, gate = _gated_core(path, tensor_parallel_size=2)
    try:
        core.add_request(EngineCoreRequest("base", PROMPT, PARAMS))
        core.add_request(EngineCoreRequest("lora", PROMPT, PARAMS,
                                           lora_request=LoRARequest("a", 1, adapter_path)))
        outputs = {}
        _step_until(core, outputs, lambda: len(steps) >= 2)
        gate.set()
        _step_until(core, outputs, lambda: not core.has_unfinished_requests())
        announced = [i for i, s in enumerate(steps) if s.lora_prefetch]
        first_run = min(i for i, s in enumerate(steps) if s.lora_ids)
        assert announced and announced[0] < first_run
        assert [r.lora_name for r in steps[announced[0]].lora_prefetch] == ["a"]
        assert outputs["lora"][0] == hf_greedy(reference, PROMPT, 8)
        assert outputs["base"][0] == hf_greedy(hf, PROMPT, 8)
    finally:
        gate.set()
        core.shutdown()


def test_a_read_begun_ahead_is_taken(tiny_models, adapters):
    """`prefetch` reads on a thread; the step that needs the adapter takes that read (one
    read in all)."""
    path, _ = tiny_models("llama")
    adapter_path, _ = adapters("llama", "deferred", seed=14,
                               target_modules=["q_proj", "v_proj", "down_proj"])
    core = EngineCore(EngineConfig(model=path, enable_lora=True, kv_cache_memory_gib=0.02,
                                   max_model_len=256), path)
    try:
        manager = core.loras.manager
        reads = []
        read = manager.read
        manager.read = lambda request: reads.append(request) or read(request)
        lora = LoRARequest("a", 1, adapter_path)
        manager.prefetch([lora])
        manager.prefetch([lora])  # (begun already: not again)
        assert manager.add(lora).request == lora and manager.holds(lora)
        assert reads == [lora]
    finally:
        core.shutdown()
