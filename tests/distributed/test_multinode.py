"""Two nodes on loopback addresses (127.0.0.2 and 127.0.0.3 of this machine), each with one
rank: started with `start_server` and the seed's variables, or with torchrun-style flags; the
API answers on node 0 as one rank does; a node's death ends the other cleanly; a node that
never joins is named."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from helpers import make_model

from tests.distributed.checks import assert_server_died, held_stream, tree
from tests.serving import Served, alive, free_port, metric_sum, wait_until
from tokenmill import LLM, SamplingParams

NODES = ("127.0.0.2", "127.0.0.3")
PROMPT = [5, 17, 99, 200, 3, 45, 67]


def _loopback_aliases_work() -> bool:
    import socket

    try:
        for address in NODES:
            with socket.socket() as s:
                s.bind((address, 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _loopback_aliases_work(),
                                reason="127.0.0.2/3 are not local addresses here")


@pytest.fixture(scope="module")
def expected(tiny_models):
    path = tiny_models("llama_long")[0]
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        (out,) = llm.generate({"prompt_token_ids": PROMPT},
                              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)
    return out.outputs[0].text


def seed_env(port: int, host_ip: str) -> dict:
    return {"MP_NUM": "2", "MP_NNODE": "2", "POD_IPS": ",".join(NODES), "POD_0_IP": NODES[0],
            "HOST_IP": host_ip, "MASTER_PORT": str(port)}


def complete(served: Served) -> str:
    answer = httpx.post(served.api + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}).json()
    return answer["choices"][0]["text"]


def tree_of(pid: int) -> list[int]:
    return [pid] + [p.pid for p in tree(pid)]


def test_seed_variables_and_start_server_on_two_nodes(tiny_models, tmp_path, expected):
    path = tiny_models("llama_long")[0]
    port = free_port()
    node1_dir = tmp_path / "node1"
    node1_dir.mkdir()
    bin_dir = os.path.dirname(sys.executable)
    started = subprocess.run([os.path.join(bin_dir, "start_server"), path], cwd=node1_dir,
                             env={**os.environ, **seed_env(port, NODES[1])},
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    assert "node 1 of 2: tensor-parallel ranks only" in started.stdout
    node1 = int((node1_dir / "log" / "server.pid").read_text())
    served = Served(path, tmp_path)
    served.env.update(seed_env(port, NODES[0]))
    try:
        with served.running():
            assert complete(served) == expected
            node1_tree = tree_of(node1)
            assert len(node1_tree) == 2  # node 1's agent and its rank
        # node 0 stopped (SIGTERM): node 1's rank was told to stop, and node 1 ended with it
        assert served.process.returncode == 0
        assert wait_until(lambda: not any(alive(pid) for pid in node1_tree), 60)
        log = (node1_dir / "log" / "server.log").read_text()
        assert "node 1: every rank stopped" in log, log[-2000:]
    finally:
        for pid in tree_of(node1) if alive(node1) else []:
            os.kill(pid, signal.SIGKILL)


TP2 = ("--tensor-parallel-size", "2")  # the nodes' default layout: one rank each


def node_flags(rank: int, port: int, layout=TP2) -> list[str]:
    return [*layout, "--nnodes", "2", "--node-rank", str(rank), "--master-addr", NODES[0],
            "--master-port", str(port)]


@contextlib.contextmanager
def two_nodes(path: str, cwd, *layout: str):
    """Node 1 (its own process group, killed as a whole) and node 0 started with
    torchrun-style flags (and `layout`'s, default two tensor-parallel ranks), node 0 ready;
    both stopped afterwards, whatever happened."""
    port = free_port()
    layout = layout or TP2
    node1 = subprocess.Popen([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", path,
                              *node_flags(1, port, layout)], cwd=cwd,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    served = Served(path, cwd, *node_flags(0, port, layout))
    served.start()
    try:
        served.wait_ready()
        yield served, node1
    finally:
        served.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait(30)


def test_torchrun_flags_and_a_node_dying_mid_stream(tiny_models, tmp_path, expected):
    with two_nodes(tiny_models("llama_long")[0], tmp_path) as (served, node1):
        assert complete(served) == expected
        stream = held_stream(served.api)
        node1_tree = tree_of(node1.pid)
        os.killpg(node1.pid, signal.SIGKILL)  # the whole node goes
        assert_server_died(served, [stream], node1_tree)


def test_deepseek_with_mtp_as_two_pipeline_stages_on_two_nodes(tmp_path):
    """DeepSeek-R1's two-node layout in small: a DeepSeek-V3 with its MTP layer served as two
    pipeline stages on two nodes, drafting with MTP on node 0's stage; the served tokens
    equal one rank's without speculation, and drafts were verified (the metrics)."""
    from tests.spec_decode.test_deepseek_mtp import _add_mtp

    path = str(tmp_path / "v3")
    _add_mtp(path, make_model(path, "deepseek_v3"))
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        (out,) = llm.generate({"prompt_token_ids": PROMPT},
                              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    with two_nodes(path, tmp_path, "--pipeline-parallel-size", "2",
                   "--speculative-config", spec) as (served, _):
        assert complete(served) == out.outputs[0].text
        assert metric_sum(served.metrics, "tokenmill:spec_decode_num_draft_tokens_total") > 0


def test_a_node_that_never_joins_is_named(tiny_models, tmp_path):
    path = tiny_models("llama")[0]
    served = Served(path, tmp_path, *node_flags(0, free_port()), "--distributed-timeout", "2")
    served.start()
    try:
        assert served.process.wait(300) != 0
        log = served.process.stdout.read().decode()
        assert "rank(s) [1] did not join within 2 s (--distributed-timeout)" in log, log[-2000:]
        assert "Node(s) [1] never joined" in log
    finally:
        served.stop()


def test_a_node_dying_while_idle_is_noticed(tiny_models, tmp_path):
    """No step runs, so no collective fails: node 0 notices the silence of node 1's agent."""
    with two_nodes(tiny_models("llama")[0], tmp_path) as (served, node1):
        os.killpg(node1.pid, signal.SIGKILL)
        assert served.process.wait(120) == 1  # (bounds a hang only; ~15 s of silence)
        log = served.process.stdout.read().decode()
        assert "node 1 has not been heard from for 15 s" in log, log[-2000:]
        assert wait_until(served.ports_free, 60)
