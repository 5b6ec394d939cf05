"""vLLM's run-time adapter routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING): an adapter loaded while
the server runs is listed and served as peft answers; loading twice, a bad folder or an
unknown unload are refused in OpenAI's shape with nothing changed; an adapter unloaded while
a request uses it serves that request to its end, then no more."""

import httpx
import openai
import pytest
from helpers import hf_greedy

from tests.serving import service_over_engine
from tokenmill.config.engine import EngineConfig

PROMPT = [5, 9, 23, 41, 7, 3]


@pytest.fixture(scope="module")
def served(tiny_models):
    path = tiny_models("llama_long")[0]
    lora = {"enable_lora": True, "max_lora_rank": 16}
    with service_over_engine(path, engine=lora, engine_config=EngineConfig(model=path, **lora),
                             allow_runtime_lora_updating=True) as thread:
        yield thread


def _models(thread) -> list[str]:
    return [m["id"] for m in httpx.get(thread.base + "/v1/models", timeout=30).json()["data"]]


def test_load_serve_unload(served, tiny_models, adapters, tmp_path):
    hf_model = tiny_models("llama_long")[1]
    path, ref = adapters("llama_long", "runtime", seed=8, target_modules=["q_proj", "v_proj",
                                                                        "down_proj"])
    base = served.base
    assert _models(served) == ["tiny"]
    resp = httpx.post(base + "/v1/load_lora_adapter",
                      json={"lora_name": "rt", "lora_path": path}, timeout=60)
    assert resp.status_code == 200
    assert resp.text == "Success: LoRA adapter 'rt' added successfully."
    assert _models(served) == ["tiny", "rt"]
    client = openai.OpenAI(base_url=base + "/v1", api_key="x")
    out = client.completions.create(model="rt", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    text = out.choices[0].text
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models("llama_long")[0])
    assert text == tok.decode(hf_greedy(ref, PROMPT, 8), skip_special_tokens=True)
    assert text != tok.decode(hf_greedy(hf_model, PROMPT, 8), skip_special_tokens=True)
    refusals = [({"lora_name": "rt", "lora_path": path}, "is already loaded"),
                ({"lora_name": "bad", "lora_path": str(tmp_path)}, "no adapter_config.json"),
                ({"lora_name": "tiny", "lora_path": path}, "the served model's own name"),
                ({"lora_name": "x"}, "must be non-empty strings")]
    for body, fragment in refusals:
        resp = httpx.post(base + "/v1/load_lora_adapter", json=body, timeout=60)
        assert resp.status_code == 400 and fragment in resp.json()["error"]["message"], resp.text
        assert "\n" not in resp.json()["error"]["message"]
    assert _models(served) == ["tiny", "rt"]
    resp = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "rt"}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert _models(served) == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="rt", prompt=PROMPT, max_tokens=2)
    resp = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "rt"}, timeout=60)
    assert resp.status_code == 404 and "cannot be found" in resp.json()["error"]["message"]


def test_unload_while_in_use(served, tiny_models, adapters):
    """The request streaming when its adapter is unloaded ends with that adapter's tokens."""
    path, ref = adapters("llama_long", "runtime-busy", seed=9, r=16,
                         target_modules=["q_proj", "k_proj", "o_proj", "up_proj"])
    base = served.base
    assert httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "busy",
                                                            "lora_path": path},
                      timeout=60).status_code == 200
    client = openai.OpenAI(base_url=base + "/v1", api_key="x")
    stream = client.completions.create(model="busy", prompt=PROMPT, max_tokens=96,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = []
    for chunk in stream:
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if len(pieces) == 2:  # (running now: unloaded under it)
            resp = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "busy"},
                              timeout=60)
            assert resp.status_code == 200, resp.text
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models("llama_long")[0])
    assert "".join(pieces) == tok.decode(hf_greedy(ref, PROMPT, 96), skip_special_tokens=True)
    assert _models(served) == ["tiny"]


def test_routes_absent_without_the_variable(server):
    resp = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "a",
                                                              "lora_path": "/x"}, timeout=30)
    assert resp.status_code == 404


def test_runtime_updates_under_data_parallel(tiny_models, adapters):
    """Two replicas behind one API: a run-time load reaches both with one id (requests on
    either replica answer as peft), an unload leaves both; a replica refusing the adapter
    (here: a lower --max-lora-rank) undoes the other's load and nothing is listed."""
    import asyncio
    import dataclasses

    from tests.serving import ServerThread, api_settings, engine_process, free_port
    from tokenmill.entrypoints.http.server import create_service_app

    path, _ = tiny_models("llama_long")
    small, ref = adapters("llama_long", "dp-small", seed=12, r=8, target_modules=["q_proj"])
    big, _ = adapters("llama_long", "dp-big", seed=13, r=16, target_modules=["v_proj"])
    engines = [engine_process(path, enable_lora=True, max_lora_rank=rank, max_loras=2)
               for rank in (16, 8)]
    try:
        settings = dataclasses.replace(
            api_settings(path, engines[0][1], allow_runtime_lora_updating=True,
                         engine_config=EngineConfig(model=path, enable_lora=True)),
            more_engine_addresses=(engines[1][1],))
        app = create_service_app(settings)
        with ServerThread(app, free_port()) as thread:
            base = f"http://127.0.0.1:{thread.port}"
            load = httpx.post(base + "/v1/load_lora_adapter",
                              json={"lora_name": "s", "lora_path": small}, timeout=60)
            assert load.status_code == 200, load.text
            refused = httpx.post(base + "/v1/load_lora_adapter",
                                 json={"lora_name": "b", "lora_path": big}, timeout=60)
            assert refused.status_code == 400
            assert "rank 16 is above --max-lora-rank (8)" in refused.json()["error"]["message"]
            models = [m["id"] for m in httpx.get(base + "/v1/models", timeout=30).json()["data"]]
            assert "s" in models and "b" not in models

            async def together():  # (in flight at once: the router spreads them)
                async with httpx.AsyncClient(timeout=120) as client:
                    return await asyncio.gather(*(client.post(base + "/v1/completions", json={
                        "model": "s", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                        "ignore_eos": True}) for _ in range(4)))

            from transformers import AutoTokenizer

            expected = AutoTokenizer.from_pretrained(path).decode(hf_greedy(ref, PROMPT, 6),
                                                                  skip_special_tokens=True)
            outs = asyncio.run(together())
            assert [o.json()["choices"][0]["text"] for o in outs] == [expected] * 4
            unload = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "s"},
                                timeout=60)
            assert unload.status_code == 200, unload.text
            again = httpx.post(base + "/v1/load_lora_adapter",
                               json={"lora_name": "s", "lora_path": small}, timeout=60)
            assert again.status_code == 200, again.text  # (both replicas had let it go)
    finally:
        for process, _ in engines:
            process.kill()
            process.join(10)
