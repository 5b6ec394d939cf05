"""Adapters by hub name (ORG/NAME), through the engine's hub code, against a fake hub on
127.0.0.1: `--lora-modules` and a run-time load fetch the adapter's files and serve it as the
same adapter from a local folder; a missing repository is one line."""

import httpx
import pytest

from tests.fake_hub import FakeHub
from tests.serving import Served


@pytest.fixture(scope="module")
def served(tiny_models, adapters, tmp_path_factory):
    path, _ = adapters("llama", "hub", seed=13, target_modules=["q_proj", "v_proj", "up_proj"])
    with FakeHub() as hub:
        hub.add("org/sql-lora", path)
        server = Served(tiny_models("llama")[0], tmp_path_factory.mktemp("lora-hub"),
                        "--enable-lora", "--max-loras", "2", "--lora-modules",
                        "hub=org/sql-lora", f"local={path}")
        server.env.update(HF_ENDPOINT=hub.url, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
                          HF_HOME=str(tmp_path_factory.mktemp("hf-home")))
        with server.running():
            yield server


def _complete(served, model: str) -> str:
    resp = httpx.post(served.api + "/v1/completions", json={
        "model": model, "prompt": [5, 9, 23, 41], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_adapter_by_hub_name(served):
    assert _complete(served, "hub") == _complete(served, "local") != _complete(served, "tiny")
    resp = httpx.post(served.api + "/v1/load_lora_adapter",
                      json={"lora_name": "again", "lora_path": "org/sql-lora"}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert _complete(served, "again") == _complete(served, "local")
    missing = httpx.post(served.api + "/v1/load_lora_adapter",
                         json={"lora_name": "gone", "lora_path": "org/missing"}, timeout=60)
    message = missing.json()["error"]["message"]
    assert missing.status_code == 400 and "LoRA adapter 'gone'" in message, message
    assert "\n" not in message and "Traceback" not in message
