"""--api-key: inference routes and the model list need the bearer token; probes do not."""

import httpx
import openai
import pytest

from tests.serving import ServerThread, api_settings, free_port
from tokenmill.entrypoints.http.server import create_service_app


@pytest.fixture(scope="module")
def keyed_server(engine_address):
    path, address = engine_address
    settings = api_settings(path, address, max_dec_len=64, max_cached_task_num=8,
                            api_key="s3cret")
    with ServerThread(create_service_app(settings), free_port()) as thread:
        yield f"http://127.0.0.1:{thread.port}"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}),
    ("/v1/chat/completions", {"text": "x", "max_dec_len": 2}),
    ("/v1/chat/completions/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v2/models/tiny/generate", {"text_input": "x", "max_tokens": 2}),
])
def test_inference_routes_need_the_key(keyed_server, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Bearer s3cret-and-more"}):
        resp = httpx.post(keyed_server + path, json=body, headers=headers, timeout=30)
        assert resp.status_code == 401, headers
        assert "s3cret" not in resp.text
    ok = httpx.post(keyed_server + path, json=body,
                    headers={"Authorization": "Bearer s3cret"}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_openai_client_with_and_without_key(keyed_server):
    good = openai.OpenAI(base_url=keyed_server + "/v1", api_key="s3cret", max_retries=0)
    assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices
    bad = openai.OpenAI(base_url=keyed_server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)


def test_vllms_ping_and_version_answer_without_a_key(keyed_server):
    from importlib.metadata import version

    assert httpx.get(keyed_server + "/ping").status_code == 200
    assert httpx.post(keyed_server + "/ping").status_code == 200  # (SageMaker's method)
    assert httpx.get(keyed_server + "/version").json() == {"version": version("tokenmill")}


def test_probes_stay_open_and_model_list_is_guarded(keyed_server):
    assert httpx.get(keyed_server + "/health").status_code == 200
    assert httpx.get(keyed_server + "/v2/health/ready").status_code == 200
    assert httpx.get(keyed_server + "/v1/models").status_code == 401
    assert httpx.get(keyed_server + "/v1/models",
                     headers={"Authorization": "Bearer s3cret"}).status_code == 200
