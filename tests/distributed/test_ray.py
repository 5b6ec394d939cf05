"""`--distributed-executor-backend ray` on a local two-node Ray cluster (head 127.0.0.2 with no
CPU for tasks, a worker node 127.0.0.3 with one): rank 1 runs as an actor on the other node,
answers as one rank does, and its death ends the server; no reachable cluster is named."""

import os
import shutil
import subprocess
import sys
import tempfile

import psutil
import pytest

from tests.distributed.checks import assert_ended_by_engine_death, held_stream
from tests.distributed.test_multinode import NODES, PROMPT, _loopback_aliases_work, complete
from tests.serving import Served, alive, free_port, wait_until
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not _loopback_aliases_work(),
                                reason="127.0.0.2/3 are not local addresses here")
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture(scope="module")
def ray_cluster():
    """HEAD:PORT of a two-node Ray cluster on loopback addresses; stopped afterwards."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="tmray", dir="/tmp")  # (unix socket paths must stay short)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    starts = [[RAY, "start", "--head", "--node-ip-address", NODES[0], "--port", str(port),
               "--num-cpus", "0", "--include-dashboard=false", "--temp-dir", temp],
              [RAY, "start", "--address", f"{NODES[0]}:{port}", "--node-ip-address", NODES[1],
               "--num-cpus", "1"]]
    try:
        for command in starts:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        yield f"{NODES[0]}:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def ray_served(path: str, tmp_path, address: str) -> Served:
    served = Served(path, tmp_path, "-tp", "2", "--distributed-executor-backend", "ray")
    served.env.update(RAY_ADDRESS=address, MASTER_PORT=str(free_port()),
                      RAY_USAGE_STATS_ENABLED="0")
    return served


def actor_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if "RankActor" in " ".join(p.info["cmdline"] or [])]


def test_a_rank_on_another_ray_node_answers_and_its_death_ends_the_server(
        tiny_models, tmp_path, ray_cluster):
    path = tiny_models("llama_long")[0]
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        (expected,) = llm.generate({"prompt_token_ids": PROMPT},
                                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   use_tqdm=False)
    served = ray_served(path, tmp_path, ray_cluster)
    served.start()
    try:
        served.wait_ready()
        assert complete(served) == expected.outputs[0].text
        (actor,) = actor_processes()
        stream = held_stream(served.api)
        actor.kill()
        assert_ended_by_engine_death(stream)
        assert served.process.wait(120) == 1
        log = served.process.stdout.read().decode()
        assert f"rank 1: a Ray actor on {NODES[1]}" in log, log[-3000:]
        assert wait_until(served.ports_free, 60)
        assert wait_until(lambda: not any(alive(p.pid) for p in actor_processes()), 60)
    finally:
        served.stop()


def test_no_reachable_ray_cluster_is_named(tiny_models, tmp_path):
    nowhere = f"127.0.0.1:{free_port()}"
    served = ray_served(tiny_models("llama")[0], tmp_path, nowhere)
    served.start()
    try:
        assert served.process.wait(300) != 0
        log = served.process.stdout.read().decode()
        assert f"no Ray cluster is reachable at {nowhere}" in log, log[-2000:]
    finally:
        served.stop()
