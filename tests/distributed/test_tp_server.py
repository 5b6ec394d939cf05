"""`tokenmill serve` with two tensor-parallel ranks (MP_NUM=2, the seed's variable): it
answers as one rank does, and a worker rank's death takes the server down cleanly."""

import os
import signal

import httpx

from tests.distributed.checks import assert_server_died, held_stream, tree, worker_ranks
from tests.serving import Served, alive, engine_process, wait_until
from tokenmill import LLM, SamplingParams


def test_served_with_two_ranks_answers_like_one_and_dies_with_a_worker(tiny_models, tmp_path):
    path = tiny_models("llama_long")[0]
    prompt = [5, 17, 99, 200, 3, 45, 67]
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        (expected,) = llm.generate({"prompt_token_ids": prompt},
                                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   use_tqdm=False)
    served = Served(path, tmp_path)
    served.env["MP_NUM"] = "2"
    served.start()
    try:
        served.wait_ready()
        answer = httpx.post(served.api + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}).json()
        text = answer["choices"][0]["text"]
        assert text == expected.outputs[0].text
        everything = tree(served.process.pid)
        workers = worker_ranks(served.process.pid)
        assert len(workers) == 1

        # A stream in flight when the worker rank is killed ends with the engine-death error.
        stream = held_stream(served.api)
        os.kill(workers[0].pid, signal.SIGKILL)
        assert_server_died(served, [stream], [p.pid for p in everything])
    finally:
        served.stop()


def test_a_killed_engine_core_takes_its_worker_ranks_along(tiny_models):
    process, _ = engine_process(tiny_models("llama")[0], tensor_parallel_size=2)
    try:
        workers = worker_ranks(process.pid)
        assert len(workers) == 1
        process.kill()  # rank 0 gone without a word (no stop message)
        assert wait_until(lambda: not alive(workers[0].pid), 60)
    finally:
        process.kill()
        process.join(10)


def test_vllm_deployment_command_line_runs_unchanged(tiny_models, tmp_path):
    """The vLLM-on-Ascend guide's command line, module path aside: every flag accepted, the
    ones with no effect here logged once, the OpenAI API answering."""
    path = tiny_models("llama_long")[0]
    guide = ("--max-num-seqs=256 --max-model-len=4096 --max-num-batched-tokens=4096 "
             "--tensor-parallel-size=1 --pipeline-parallel-size=1 --block-size=128 "
             "--gpu-memory-utilization=0.9 --num-scheduler-steps=8 "
             "--distributed-executor-backend mp --trust-remote-code --enforce-eager "
             "--disable-async-output-proc")
    served = Served(path, tmp_path, *guide.split(" "))
    served.entry = ("-m", "tokenmill.entrypoints.openai.api_server")
    served.args[0:1] = ["--model", path]
    with served.running():
        answer = httpx.post(served.api + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "The quick", "max_tokens": 4}).json()
        assert answer["usage"]["completion_tokens"] == 4
    log = served.process.stdout.read().decode()
    for flag in ("--num-scheduler-steps", "--trust-remote-code",
                 "--disable-async-output-proc"):
        assert f"{flag}: accepted, no effect here" in log, log[-2000:]


def test_a_stalled_worker_rank_is_an_engine_death_with_no_orphan(tiny_models, tmp_path):
    """A worker rank stopped mid-step (SIGSTOP: alive, silent) stalls rank 0 in its
    all-reduce: past the stall limit the server fails the stream and exits 1, and the stopped
    worker is killed with its engine core (nothing is left to resume)."""
    served = Served(tiny_models("llama_long")[0], tmp_path)
    served.env.update(MP_NUM="2", CHECK_HEALTH_INTERVAL="2",
                      VLLM_ENGINE_ITERATION_TIMEOUT_S="2")
    served.start()
    try:
        served.wait_ready()
        (worker,) = worker_ranks(served.process.pid)
        stream = held_stream(served.api)
        os.kill(worker.pid, signal.SIGSTOP)
        assert_server_died(served, [stream], [worker.pid])
    finally:
        served.stop()
