"""Sleep mode and weight updates over HTTP (entrypoints/http/sleep_api.py) against a real
engine-core process: vLLM's /sleep, /wake_up, /is_sleeping and SGLang's
/update_weights_from_disk; a sleeping server answers generation with 503 (each API's shape,
Retry-After) and is not ready; a request in flight makes /sleep a 409 and is served to its
end; outputs after waking and after an update equal transformers' over those weights."""

import glob
import os
import shutil
import tempfile

import httpx
import msgspec
import openai
import pytest
import torch
from helpers import hf_greedy

from tests.serving import HOLD_TOKENS, metric, service_over_engine, wait_until
from tokenmill.config.engine import EngineConfig
from tokenmill.entrypoints.api.state import readiness

PROMPT = [5, 9, 23, 41, 7, 3]


@pytest.fixture(scope="module")
def served(tiny_models):
    path = tiny_models("llama_long")[0]
    with service_over_engine(path, engine={"enable_sleep_mode": True},
                             engine_config=EngineConfig(model=path,
                                                        enable_sleep_mode=True)) as thread:
        yield thread


def _complete(base: str) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x")
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _greedy_text(path, hf) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).decode(hf_greedy(hf, PROMPT, 6),
                                                      skip_special_tokens=True)


def test_sleep_wake_and_update(served, tiny_models, tmp_path):
    path, hf = tiny_models("llama_long")
    base = served.base
    # (the model's own weights, whatever another test of this module left served)
    assert httpx.post(base + "/update_weights_from_disk", json={"model_path": path},
                      timeout=300).status_code == 200
    assert _complete(base) == _greedy_text(path, hf)
    assert httpx.get(base + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    for level in ("0", "3", "x"):
        resp = httpx.post(base + "/sleep", params={"level": level}, timeout=60)
        assert resp.status_code == 400 and "level must be 1 or 2" in resp.text
    for level in ("1", "2"):
        assert httpx.post(base + "/sleep", params={"level": level}, timeout=60).status_code == 200
        assert httpx.get(base + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        assert readiness(served.app.state.server) == (False, "engine is sleeping")
        resp = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                          "max_tokens": 2}, timeout=60)
        assert resp.status_code == 503 and resp.headers.get("retry-after")
        assert "sleeping" in resp.json()["error"]["message"]
        resp = httpx.post(base + "/v1/messages", json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            timeout=60)
        assert resp.status_code == 503 and resp.json()["type"] == "error"
        # an API process that has not heard yet: the engine core refuses, also a 503
        engine = served.app.state.server.engine
        engine.stats = msgspec.structs.replace(engine.stats, sleeping=0)
        resp = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                          "max_tokens": 2}, timeout=60)
        assert resp.status_code == 503 and "sleeping" in resp.json()["error"]["message"]
        assert httpx.post(base + "/wake_up", timeout=300).status_code == 200
        assert not served.app.state.server.engine.sleeping
        assert _complete(base) == _greedy_text(path, hf)
    # another checkpoint's weights (SGLang's route and answer)
    from transformers import AutoModelForCausalLM

    other = str(tmp_path / "other")
    shutil.copytree(path, other)
    hf = AutoModelForCausalLM.from_pretrained(path)  # (not the session's model: a copy)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=g))
    hf.save_pretrained(other)
    resp = httpx.post(base + "/update_weights_from_disk", json={"model_path": other},
                      timeout=300)
    assert resp.status_code == 200 and resp.json() == {"success": True,
                                                       "message": "Weights updated."}
    assert _complete(base) == _greedy_text(path, hf)
    for body in ({"model_path": str(tmp_path / "none")}, {"model_path": ""}, [1]):
        resp = httpx.post(base + "/update_weights_from_disk", json=body, timeout=60)
        assert resp.status_code in (400, 409) and resp.json()["success"] is False, resp.text
    assert _complete(base) == _greedy_text(path, hf)


def test_a_request_in_flight_makes_sleep_a_conflict(served):
    base = served.base
    client = openai.OpenAI(base_url=base + "/v1", api_key="x")
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=HOLD_TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # (running now)
    resp = httpx.post(base + "/sleep", params={"level": "1"}, timeout=60)
    assert resp.status_code == 409 and "needs an idle engine: 1 request" in resp.text
    stream.close()  # (aborted: the engine is idle again once the server has seen it go)
    engine = served.app.state.server.engine
    assert wait_until(lambda: engine.num_in_flight() == 0 and not engine.stats.num_running, 60)
    assert httpx.get(base + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}


def test_without_sleep_mode_the_routes_say_how_to_turn_it_on(server_thread):
    resp = httpx.post(server_thread.base + "/sleep", timeout=60)
    assert resp.status_code == 400 and "--enable-sleep-mode" in resp.json()["error"]["message"]


def test_data_parallel_replicas_sleep_and_wake_together(tiny_models, tmp_path):
    """`tokenmill serve` as a process tree with two replicas: each sleeps (the server is not
    ready, generation 503) and wakes; the server serves after."""
    from tests.serving import Served

    served = Served(tiny_models("llama_long")[0], tmp_path, "--data-parallel-size", "2",
                    "--kv-cache-memory", "0.04", "--enable-sleep-mode")
    served.start()
    try:
        served.wait_ready()
        base = served.api
        text = _complete(base)
        assert httpx.post(base + "/sleep", params={"level": "2"}, timeout=120).status_code == 200
        assert httpx.get(base + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        assert httpx.get(served.health + "/v2/health/ready", timeout=10).status_code != 200
        assert [metric(served.metrics, "tokenmill:engine_sleep_level", engine=e)
                for e in ("0", "1")] == [2, 2]
        resp = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                          "max_tokens": 2}, timeout=60)
        assert resp.status_code == 503
        assert httpx.post(base + "/wake_up", timeout=300).status_code == 200
        assert wait_until(served.ready, 30)
        assert httpx.get(base + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}
        assert wait_until(lambda: metric(served.metrics, "tokenmill:engine_sleep_level",
                                         engine="1") == 0, 30)
        assert _complete(base) == text
    finally:
        served.stop()


def test_weights_from_a_trainer_group_over_http(served, tiny_models, tmp_path):
    """SGLang's three routes against the engine process: the trainer (this process) hosts
    the group and broadcasts; the server then answers as transformers over those weights."""
    import threading

    from transformers import AutoModelForCausalLM

    from tests.engine.test_sleep_mode import _trainer
    from tests.serving import free_port

    path = tiny_models("llama_long")[0]
    hf = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=g))
    base, port, ready = served.base, free_port(), threading.Event()
    resp = httpx.post(base + "/update_weights_from_distributed",
                      json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}, timeout=60)
    assert resp.status_code == 409 and "init_weights_update_group first" in resp.text
    thread, tensors = _trainer(hf, port, ready)
    resp = httpx.post(base + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
        "world_size": 2, "group_name": "weight_update_group", "backend": "gloo"}, timeout=120)
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    ready.set()
    resp = httpx.post(base + "/update_weights_from_distributed", json={
        "names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.")
                                           for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()]}, timeout=300)
    assert resp.status_code == 200 and resp.json() == {"success": True,
                                                       "message": "Weights updated."}
    thread.join(60)
    assert _complete(base) == _greedy_text(path, hf)
    for route, body in (("/init_weights_update_group", {"master_address": "127.0.0.1"}),
                        ("/update_weights_from_distributed", {"names": "x"})):
        resp = httpx.post(base + route, json=body, timeout=60)
        assert resp.status_code == 400 and resp.json()["success"] is False
    assert httpx.post(base + "/destroy_weights_update_group", timeout=60).status_code == 200
    # (an update from disk removes the staged folder: the engine process is killed at the
    # module's end, before it could remove it itself)
    staged = glob.glob(os.path.join(tempfile.gettempdir(), "tokenmill-weights-*"))
    assert httpx.post(base + "/update_weights_from_disk", json={"model_path": path},
                      timeout=300).status_code == 200
    assert not set(staged) & set(glob.glob(os.path.join(tempfile.gettempdir(),
                                                         "tokenmill-weights-*")))
