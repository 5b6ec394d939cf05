"""Asynchronous scheduling (`async_scheduling=True`): the next step is scheduled and launched
before the last one's tokens reach the host, its decodes reading them on the device. It
changes when work is issued, never the tokens: every test compares against the synchronous
engine (itself checked against transformers elsewhere) or transformers directly."""

import asyncio
import importlib.util
import random

import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.config.engine import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerConfig


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    shared = [rng.randrange(2, 500) for _ in range(24)]
    out = [shared + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 20))]
           for _ in range(3)]
    out += [[rng.randrange(2, 500) for _ in range(n)] for n in (3, 17, 64, 90)]
    return [{"prompt_token_ids": p} for p in out]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def results(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def both(path, prompts, params, **engine):
    """(synchronous, asynchronous) results of the same requests, and the async LLM."""
    sync = LLM(path, **engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, async_scheduling=True, **engine)
    return results(sync), results(llm.generate(prompts, params, use_tqdm=False)), llm


def record_steps(monkeypatch, runner):
    """Log of 'launch' / 'complete', in call order (launches of nothing left out)."""
    log = []
    launch, complete = runner.launch, runner.complete

    def logged_launch(step):
        launched = launch(step)
        if launched is not None:
            log.append("launch")
        return launched

    def logged_complete(launched):
        log.append("complete")
        return complete(launched)
    monkeypatch.setattr(runner, "launch", logged_launch)
    monkeypatch.setattr(runner, "complete", logged_complete)
    return log


def overlapped(log) -> int:
    """How many steps were launched while an earlier one was still waiting for its tokens."""
    waiting, count = 0, 0
    for kind in log:
        if kind == "launch":
            count += waiting > 0
            waiting += 1
        else:
            waiting -= 1
    return count


@pytest.mark.parametrize("engine", [
    {"kv_cache_memory_gib": 0.05},
    {"kv_cache_memory_gib": 0.05, "max_num_batched_tokens": 7},  # chunked prefill
    {"num_kv_blocks": 20, "block_size": 8},  # preemption
    {"kv_cache_memory_gib": 0.05, "max_num_seqs": 2},  # requests join as others finish
], ids=["batched", "chunked", "preempted", "two-seqs"])
def test_same_tokens_as_synchronous(tiny_models, prompts, engine, monkeypatch):
    path, hf = tiny_models("qwen2")
    params = [greedy(3 + 4 * i) for i in range(len(prompts))]
    sync, got, llm = both(path, prompts, params, **engine)
    assert got == sync
    assert got[3][0] == hf_greedy(hf, prompts[3]["prompt_token_ids"], 15)
    core = llm.engine.core
    assert core.kv_cache.pool.num_free_blocks == core.kv_cache.num_blocks
    core.kv_cache.pool.check_integrity()
    if "num_kv_blocks" in engine:
        assert core.scheduler.num_preemptions > 0
    # and the steps did overlap: most launched before the previous one's tokens came back
    log = record_steps(monkeypatch, core.runner)
    assert results(llm.generate(prompts, params, use_tqdm=False)) == sync
    assert overlapped(log) >= 10
    assert all(not r.num_pending for r in core.scheduler.requests.values())


def test_stops_found_one_step_late_change_nothing(tiny_models, prompts):
    # A request whose stop token comes up has its next step launched already; that step's
    # token is dropped. Stop tokens picked from each request's own greedy output.
    path = tiny_models("qwen2")[0]
    plain = LLM(path, kv_cache_memory_gib=0.05).generate(prompts, greedy(12), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=12,
                             stop_token_ids=[o.outputs[0].token_ids[2 + i % 5]])
              for i, o in enumerate(plain)]
    sync, got, _ = both(path, prompts, params, kv_cache_memory_gib=0.05)
    assert got == sync
    assert {reason for _, reason in got} == {"stop"}
    assert all(len(tokens) <= 2 + i % 5 + 1 for i, (tokens, _) in enumerate(got))


def test_min_tokens_counts_the_pending_token(tiny_models, prompts, monkeypatch):
    # min_tokens bans stop tokens while fewer outputs precede the one being drawn; running
    # ahead, one of those is still on the device. Each request's stop token is its own greedy
    # token at index m = min_tokens: banned one token too long, the output would differ.
    path = tiny_models("qwen2")[0]
    plain = LLM(path, kv_cache_memory_gib=0.05).generate(prompts, greedy(12), use_tqdm=False)
    ms = [1 + i % 4 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=m,
                             stop_token_ids=[o.outputs[0].token_ids[m]])
              for m, o in zip(ms, plain)]
    sync_llm = LLM(path, kv_cache_memory_gib=0.05)
    sync = results(sync_llm.generate(prompts, params, use_tqdm=False))
    llm = LLM(path, kv_cache_memory_gib=0.05, async_scheduling=True)
    log = record_steps(monkeypatch, llm.engine.core.runner)
    assert results(llm.generate(prompts, params, use_tqdm=False)) == sync
    assert overlapped(log) >= 3
    # where the stop token did not come up earlier, the synchronous engine stops right at it
    for m, o, (tokens, reason) in zip(ms, plain, sync):
        if o.outputs[0].token_ids[m] not in o.outputs[0].token_ids[:m]:
            assert (len(tokens), reason) == (m + 1, "stop")


def test_penalties_count_the_pending_token(tiny_models, prompts, monkeypatch):
    # a decode running ahead samples with its latest token still on the device: the
    # penalties take it from there
    path = tiny_models("qwen2")[0]
    kinds = [{"repetition_penalty": 1.5}, {"presence_penalty": 1.5},
             {"frequency_penalty": 1.0}, {"repetition_penalty": 1.2, "frequency_penalty": 0.5},
             {}]
    params = [greedy(14, **kinds[i % len(kinds)]) for i in range(len(prompts))]
    sync = results(LLM(path, kv_cache_memory_gib=0.05).generate(prompts, params,
                                                                use_tqdm=False))
    llm = LLM(path, kv_cache_memory_gib=0.05, async_scheduling=True)
    log = record_steps(monkeypatch, llm.engine.core.runner)
    assert results(llm.generate(prompts, params, use_tqdm=False)) == sync
    assert overlapped(log) >= 10
    # (and the penalties change these outputs: without them the test would prove nothing)
    assert sync != results(LLM(path, kv_cache_memory_gib=0.05).generate(
        prompts, greedy(14), use_tqdm=False))


def test_logprobs_run_ahead(tiny_models, prompts, monkeypatch):
    # sample and prompt logprobs are computed with the step and read on the host with its
    # tokens: the same values, steps still overlapping
    path = tiny_models("qwen2")[0]
    params = [greedy(10, logprobs=i % 3, prompt_logprobs=(i + 1) % 3 or None)
              for i in range(len(prompts))]
    sync = LLM(path, kv_cache_memory_gib=0.05).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, kv_cache_memory_gib=0.05, async_scheduling=True)
    log = record_steps(monkeypatch, llm.engine.core.runner)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert results(got) == results(sync)
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in sync]
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in sync]
    assert all(o.outputs[0].logprobs for o in got[1::3])
    assert overlapped(log) >= 8


def test_seeded_sampling_unchanged(tiny_models, prompts):
    # each request's own generator draws in the same order either way
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, ignore_eos=True,
                             seed=100 + i) for i in range(len(prompts))]
    sync, got, _ = both(tiny_models("qwen2")[0], prompts, params, kv_cache_memory_gib=0.05)
    assert got == sync


def test_requests_that_need_their_tokens_run_one_step_at_a_time(tiny_models, prompts,
                                                                 monkeypatch):
    # bad words and grammars read a request's tokens on the host before its next step: while
    # one runs, steps do not overlap
    path = tiny_models("qwen2")[0]
    grammar = ({"choice": ["red apple", "green pear"]}
               if importlib.util.find_spec("xgrammar") else None)  # (an extra: not everywhere)
    params = [greedy(10), greedy(10, bad_words=["ab"]), greedy(10), greedy(10),
              greedy(10, structured_outputs=grammar), greedy(10),
              greedy(10, bad_words=["c d"])]
    sync_llm = LLM(path, kv_cache_memory_gib=0.05)
    sync = sync_llm.generate(prompts, params, use_tqdm=False)
    llm = LLM(path, kv_cache_memory_gib=0.05, async_scheduling=True)
    log = record_steps(monkeypatch, llm.engine.core.runner)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert results(got) == results(sync)
    assert overlapped(log) == 0
    # with only plain requests left, they overlap again
    log.clear()
    llm.generate(prompts[:2], greedy(10), use_tqdm=False)
    assert overlapped(log) >= 8


def test_abort_while_a_step_runs_ahead(tiny_models, prompts):
    path = tiny_models("qwen2")[0]
    want = LLM(path, kv_cache_memory_gib=0.05).generate(prompts[2:4], greedy(16),
                                                        use_tqdm=False)
    llm = LLM(path, kv_cache_memory_gib=0.05, async_scheduling=True)
    engine = llm.engine
    ids = [engine.add_request(None, p, greedy(16)) for p in prompts[:4]]
    for _ in range(4):
        engine.step()
    assert engine.core.batch_queue  # a step is in flight as the abort comes
    engine.abort_request(ids[:2])
    finished = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert list(finished) == ids[2:]
    assert list(finished.values()) == [o.outputs[0].token_ids for o in want]
    pool = engine.core.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_graph_decode_steps_take_the_tokens_on_the_device(tiny_models, monkeypatch):
    # CUDA-graph decode buckets (run eagerly on the CPU) with the tokens filled in on the
    # device, under the Triton kernels (interpreter)
    path, hf = tiny_models("llama")
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    llm = LLM(path, kv_cache_memory_gib=0.01, attention_backend="triton", max_num_seqs=4,
              async_scheduling=True)
    graphs = llm.engine.core.runner.graphs
    filled = []
    original = graphs.run
    monkeypatch.setattr(graphs, "run", lambda inputs, fill=None: filled.append(
        fill is not None) or original(inputs, fill))
    prompts = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert filled.count(True) >= 3


def test_engine_process_streams_the_same_tokens(tiny_models, prompts):
    # the serving path: the engine core's busy loop, a stop string ending a request from the
    # API side while its next step is in flight
    from tests.engine.test_async_engine import collect, with_engine
    from tokenmill.engine.core_client import start_engine_core_process

    path = tiny_models("qwen2")[0]
    offline = LLM(path, kv_cache_memory_gib=0.02).generate(prompts, greedy(12),
                                                           use_tqdm=False)
    # float32 as the offline engine (the GPU test runs' float32 patch stays in this process)
    config = EngineConfig(model=path, kv_cache_memory_gib=0.02, async_scheduling=True,
                          dtype="float32")
    process, address, _ = start_engine_core_process(config, path)
    stop = offline[0].outputs[0].text[3:6]
    try:
        async def body(llm):
            outs = await asyncio.gather(*(collect(llm, p["prompt_token_ids"], greedy(12))
                                          for p in prompts))
            stopped = await collect(llm, prompts[0]["prompt_token_ids"],
                                    greedy(12, stop=[stop]))
            return outs, stopped
        outs, stopped = asyncio.run(with_engine(path, address, body))
    finally:
        process.kill()
        process.join(10)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in offline]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].text == offline[0].outputs[0].text[:offline[0].outputs[0].text
                                                                 .index(stop)]


# ---- the scheduler's side -------------------------------------------------------------------

def scheduler(max_len=256):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                     max_model_len=max_len), KVCacheManager(64, 4))


def test_pending_decode_runs_ahead_only_when_asked_and_allowed():
    s = scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    s.add_request(Request("b", [4, 5, 6], SamplingParams(max_tokens=4, bad_words_token_ids=[[9]])))
    first = s.schedule()
    assert [x.request.num_pending for x in first.scheduled] == [1, 1]
    assert s.schedule().empty  # both tokens pending: nothing to run synchronously
    ahead = s.schedule(async_scheduling=True)
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in ahead.scheduled] == [
        ("a", 3, 1)]  # b's bad words are matched against its tokens on the host
    assert s.requests["a"].num_pending == 2 and s.requests["a"].num_computed_tokens == 4
    s.update_from_output(first, {"a": [7], "b": [8]})
    assert (s.requests["a"].num_pending, s.requests["b"].num_pending) == (1, 0)
    s.update_from_output(ahead, {"a": [9]})
    assert s.requests["a"].output_token_ids == [7, 9] and s.requests["a"].num_pending == 0


def test_last_token_pending_is_not_run_past():
    # max_tokens and the model's length: the pending token is the request's last
    s = scheduler(max_len=5)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=1)))
    s.add_request(Request("b", [4, 5, 6, 7], SamplingParams(max_tokens=9)))
    s.add_request(Request("c", [4, 5], SamplingParams(max_tokens=9)))
    first = s.schedule()
    ahead = s.schedule(async_scheduling=True)
    assert [x.request.request_id for x in ahead.scheduled] == ["c"]
    updated = s.update_from_output(first, {"a": [7], "b": [8], "c": [9]})
    assert [(r.request_id, r.status.finished) for r, _ in updated] == [
        ("a", True), ("b", True), ("c", False)]


def test_preempting_a_request_drops_its_pending_token():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64),
                  KVCacheManager(2, 4))
    s.add_request(Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=9)))
    s.add_request(Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=9)))
    first = s.schedule()
    ahead = s.schedule(async_scheduling=True)  # a needs a third block: b is preempted for it
    assert [x.request.request_id for x in ahead.scheduled] == ["a"]
    b = s.waiting[0]
    assert b.request_id == "b" and b.num_pending == 0 and b.num_computed_tokens == 0
    updated = s.update_from_output(first, {"a": [10], "b": [11]})
    assert [r.request_id for r, _ in updated] == ["a"] and b.output_token_ids == []


def test_serve_flag():
    from tokenmill.config.server import build_server_config

    assert build_server_config(["--async-scheduling"], {}).engine.async_scheduling
    assert not build_server_config([], {}).engine.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        build_server_config(["--async-scheduling", "--pipeline-parallel-size", "2"], {})
    # tensor parallel: tests/distributed/test_tensor_parallel.py runs it
    assert build_server_config(["--async-scheduling", "--tensor-parallel-size", "2"],
                               {}).engine.async_scheduling


def test_config_refuses_what_it_cannot_run_with():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram",
                                                                 "num_speculative_tokens": 2})


def test_host_copy_of_device_tokens():
    from tokenmill.host_to_device import HostCopy

    tokens = torch.tensor([3, 1, 4])
    assert HostCopy(tokens).tolist() == [3, 1, 4]
    if torch.cuda.is_available():
        assert HostCopy(tokens.cuda() * 2).tolist() == [6, 2, 8]
