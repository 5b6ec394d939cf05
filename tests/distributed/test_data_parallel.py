"""Data parallel: replicas behind one API. Requests sharing a prompt prefix go to the replica
that holds it even when it is busier; others go to the least loaded; a replica's crash takes
the server down cleanly."""

import os
import signal

import psutil
import pytest

from tests.distributed.checks import assert_server_died, held_stream
from tests.serving import Served, metric, wait_until
from tokenmill.engine.dp_client import PrefixRouter

PREFIX = "The quick brown fox jumps over the lazy dog. " * 6


def test_router_prefers_the_cached_prefix_then_the_least_loaded():
    router = PrefixRouter(2, block_size=4)
    shared = list(range(100, 120))
    assert router.choose(shared + [1]) == 0  # a tie: the lowest index
    assert router.choose([7, 8, 9, 10, 11]) == 1  # no prefix anywhere: the idle one
    assert router.choose([1, 2, 3, 4]) == 0  # no prefix, a tie on load: the lowest index
    assert router.choose(shared + [2]) == 0  # the prefix wins over load (2 vs 1)
    assert router.in_flight == [3, 1]
    assert router.choose([50, 51, 52, 53]) == 1  # least loaded
    for _ in range(3):
        router.done(0)
    assert router.choose(shared[:3]) == 0  # shorter than a block: no prefix, least loaded


def running(served: Served, engine: str) -> float:
    return metric(served.metrics, "tokenmill:num_requests_running", engine=engine)


def test_two_replicas_route_by_prefix_then_load_and_die_together(tiny_models, tmp_path):
    # (the KV budget is the machine's, shared by the replicas: each gets the 0.02 GiB a
    # single engine gets in the other tests)
    served = Served(tiny_models("llama_long")[0], tmp_path, "--data-parallel-size", "2",
                    "--kv-cache-memory", "0.04")
    served.start()
    try:
        served.wait_ready()
        engines = [p for p in psutil.Process(served.process.pid).children()
                   if "spawn_main" in " ".join(p.cmdline())]
        assert len(engines) == 2
        first = held_stream(served.api, PREFIX + "first")
        second = held_stream(served.api, PREFIX + "second")  # the first's prefix: same replica
        other = held_stream(served.api, "Paris is the capital of France, and Tokens flow")
        assert wait_until(lambda: (running(served, "0"), running(served, "1")) == (2, 1), 60)
        assert metric(served.metrics, "tokenmill:kv_cache_blocks_total", engine="1") > 0
        # One replica crashes: every stream ends with the engine-death error, the server
        # exits 1 and no engine process is left.
        os.kill(engines[1].pid, signal.SIGKILL)
        assert_server_died(served, [first, second, other], [p.pid for p in engines])
    finally:
        served.stop()


def test_offline_replicas_answer_as_one_engine_and_refuse_alike(tiny_models):
    from tests.distributed.test_tensor_parallel import MAX_TOKENS, PROMPTS, generate
    from tokenmill import LLM, SamplingParams

    path, _ = tiny_models("llama")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    one = generate(path, PROMPTS, params)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(path, kv_cache_memory_gib=0.01, data_parallel_size=2) as llm:
        replicas = list(llm.engine.client.processes)
        two = llm.generate(prompts, params, use_tqdm=False)
        router = llm.engine.client.router
        assert router.in_flight == [0, 0]  # every request left the books
        assert router.blocks[1]  # the second replica got the long prompts (least loaded)
        with pytest.raises(ValueError, match="leaves no room to generate"):
            llm.generate({"prompt_token_ids": [5] * 2000}, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)  # the engine is still fine
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in one]
    assert len(replicas) == 2 and not any(p.is_alive() for p in replicas)
