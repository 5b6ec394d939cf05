"""Priority scheduling through the engine, by order and cause: with every slot held by
long low-priority requests, a high-priority arrival gets its first token in the step after
it arrives (a low-priority request preempted for it) where FCFS makes it wait for a slot;
every answer, preempted ones included, equals the request's answer alone. Over HTTP the
field is taken by the OpenAI, native and Triton routes, and refused under FCFS."""

import httpx
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config.engine import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.protocol import EngineCoreRequest

LOW = [[5, 9, 23, 41], [11, 12, 13, 14], [100, 3, 77, 2]]
HIGH = [60, 61, 62, 63, 64]
LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _first_token_step(path, policy):
    """(step at which the high-priority request got its first token, counted from its
    arrival; preemptions; every request's tokens)."""
    core = EngineCore(EngineConfig(model=path, kv_cache_memory_gib=0.02, max_model_len=256,
                                   max_num_seqs=len(LOW), scheduling_policy=policy), path)
    try:
        for i, prompt in enumerate(LOW):
            core.add_request(EngineCoreRequest(f"low{i}", prompt, LONG,
                                               priority=5 if policy == "priority" else 0))
        tokens = {}

        def step():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

        for _ in range(3):  # (the low requests hold every slot, decoding)
            step()
        core.add_request(EngineCoreRequest("high", HIGH, SHORT))
        first = None
        for n in range(1, 200):  # (bounded: the longest request ends in ~45 steps)
            step()
            if first is None and tokens.get("high"):
                first = n
            if not core.has_unfinished_requests():
                break
        return first, core.scheduler.num_preemptions, tokens
    finally:
        core.shutdown()


def test_a_high_priority_arrival_runs_at_once(tiny_models):
    path = tiny_models("llama")[0]
    first, preemptions, tokens = _first_token_step(path, "priority")
    fcfs_first, fcfs_preemptions, fcfs_tokens = _first_token_step(path, "fcfs")
    assert first == 1 and preemptions >= 1  # (its cause: a low-priority request made room)
    assert fcfs_first > 30 and fcfs_preemptions == 0  # (it waited for a slot to free)
    with LLM(path, max_model_len=256) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in LOW + [HIGH]], [LONG] * len(LOW) + [SHORT],
            use_tqdm=False)]
    assert [tokens[f"low{i}"] for i in range(len(LOW))] + [tokens["high"]] == alone
    assert fcfs_tokens == tokens


def test_offline_priority_and_its_refusal(tiny_models):
    path = tiny_models("llama")[0]
    with LLM(path, max_model_len=256) as llm, pytest.raises(ValueError,
                                                           match="scheduling-policy priority"):
        llm.generate([{"prompt_token_ids": HIGH}], SHORT, use_tqdm=False, priority=[1])
    with LLM(path, max_model_len=256, scheduling_policy="priority") as llm:
        out = llm.generate([{"prompt_token_ids": p} for p in LOW], SHORT, use_tqdm=False,
                           priority=[2, 0, 1])
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_routes_take_priority(tiny_models):
    from tests.serving import service_over_engine

    path = tiny_models("llama")[0]
    with service_over_engine(path, engine={"scheduling_policy": "priority"},
                             engine_config=EngineConfig(model=path,
                                                        scheduling_policy="priority")) as s:
        openai = httpx.post(s.base + "/v1/completions", json={
            "model": "tiny", "prompt": HIGH, "max_tokens": 3, "priority": -3}, timeout=60)
        native = httpx.post(s.base + "/v1/chat/completions", json={
            "input_ids": HIGH, "max_dec_len": 3, "priority": 7}, timeout=60)
        triton = httpx.post(s.base + "/v2/models/ensemble/generate", json={
            "text_input": "hi", "max_tokens": 3, "priority": 2}, timeout=60)
        bad = httpx.post(s.base + "/v1/chat/completions", json={
            "input_ids": HIGH, "priority": "high"}, timeout=60)
    assert openai.status_code == 200 and native.status_code == 200, (openai.text, native.text)
    assert triton.status_code == 200, triton.text
    assert bad.status_code == 400 and "priority" in bad.json()["error_msg"]
