"""Fair share and queue deadlines through an engine core over a tiny model: two tenants
weighted 1:3 that keep the engine saturated get output tokens 1:3 (within 10 %), and every
answer equals the request's answer alone; a request kept waiting past its max_queue_time is
refused with a retry time (the core's clock is the test's), one that started is not."""

import types
from collections import Counter

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config.engine import EngineConfig
from tokenmill.engine import engine_core
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.protocol import EngineCoreRequest

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompt(i):
    return [3 + i % 50, 7 + i % 13, 11 + i % 7, 2 + i % 5]


def test_output_tokens_follow_the_weights(tiny_models):
    path = tiny_models("llama")[0]
    core = EngineCore(EngineConfig(model=path, kv_cache_memory_gib=0.02, max_model_len=256,
                                   max_num_seqs=8, scheduling_policy="fair",
                                   tenant_weights="a=1,b=3"), path)
    outputs, tokens, steps = {}, Counter(), 0
    try:
        for i in range(48):
            for tenant in "ab":
                core.add_request(EngineCoreRequest(f"{tenant}{i}", prompt(i), PARAMS,
                                                   tenant=tenant))
        waiting = lambda t: any(r.tenant == t for r in core.scheduler.waiting)  # noqa: E731
        while core.has_unfinished_requests():
            measuring = steps >= 20 and waiting("a") and waiting("b")
            for out in core.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if measuring:
                    tokens[out.request_id[0]] += len(out.new_token_ids)
            steps += 1
            assert steps < 5000
    finally:
        core.shutdown()
    assert tokens["a"] > 50 and tokens["b"] / tokens["a"] == pytest.approx(3.0, rel=0.10), tokens
    with LLM(path, max_model_len=256) as llm:  # (each answer: the request's alone)
        alone = llm.generate([{"prompt_token_ids": prompt(i)} for i in range(48)], PARAMS,
                             use_tqdm=False)
    for i, out in enumerate(alone):
        assert outputs[f"a{i}"] == outputs[f"b{i}"] == list(out.outputs[0].token_ids)


def test_a_request_that_waited_too_long_is_refused(tiny_models, monkeypatch):
    path = tiny_models("llama")[0]
    clock = [100.0]
    monkeypatch.setattr(engine_core, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    core = EngineCore(EngineConfig(model=path, kv_cache_memory_gib=0.02, max_model_len=256,
                                   max_num_seqs=1, max_queue_time=30), path)
    try:
        core.add_request(EngineCoreRequest("first", prompt(0), PARAMS))
        core.add_request(EngineCoreRequest("second", prompt(1), PARAMS, max_queue_time=2.5))
        core.add_request(EngineCoreRequest("third", prompt(2), PARAMS))
        seen = {}
        for _ in range(3):
            for out in core.step():
                seen.setdefault(out.request_id, []).append(out)
        assert set(seen) == {"first"}  # (it started: no deadline applies to it now)
        clock[0] += 2.6  # (past second's own limit, within the engine's 30 s)
        refused = core.step()
        assert [o.request_id for o in refused] == ["second"]
        assert refused[0].retry_after == 3 and "max_queue_time" in refused[0].error
        clock[0] += 30
        assert [o.request_id for o in core.step()] == ["third"]
        while core.has_unfinished_requests():
            for out in core.step():
                seen.setdefault(out.request_id, []).append(out)
        assert sum(len(o.new_token_ids) for o in seen["first"]) == 12
        assert all(o.error is None for o in seen["first"])
    finally:
        core.shutdown()


def test_bad_values_are_refused_by_name(tiny_models):
    path = tiny_models("llama")[0]
    for kwargs, match in (({"tenant_weights": "a=1"}, "needs --scheduling-policy fair"),
                          ({"scheduling_policy": "fair", "tenant_weights": "a=0"}, "a's weight"),
                          ({"scheduling_policy": "fair", "tenant_weights": "a b=1"},
                           "tenant name"),
                          ({"scheduling_policy": "fair", "tenant_weights": "{1"}, "not valid JSON"),
                          ({"max_queue_time": -1}, "max_queue_time"),
                          ({"max_queue_time": float("inf")}, "max_queue_time")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(model=path, **kwargs)
