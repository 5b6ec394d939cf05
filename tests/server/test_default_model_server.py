"""The default model (SmolLM2-135M-Instruct from its GGUF) behind `tokenmill serve`, spoken to
the way users do: the seed's client snippet, the openai SDK on both base URLs, Triton generate."""

import json

import httpx
import openai
import pytest
import requests

from tests.serving import Served

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    served = Served("", tmp_path_factory.mktemp("default"), "--max-model-len", "1024")
    served.args.remove("")  # no MODEL argument: the bundled default
    served.args[served.args.index("tiny")] = "smollm2"
    with served.running(timeout=300):
        yield served


def test_seed_client_snippet_streams_the_answer(default_server):
    url = default_server.api + "/v1/chat/completions"
    body = {"text": QUESTION, "temperature": 0, "max_dec_len": 24, "stream": True,
            "req_id": "france"}
    tokens = []
    with requests.post(url, json=body, stream=True, timeout=120) as resp:
        for line in resp.iter_lines():
            if line:
                message = json.loads(line)
                assert message["error_code"] == 0
                tokens.append(message["token"])
    assert "Paris" in "".join(tokens)
    whole = requests.post(url, json={**body, "stream": False}, timeout=120).json()
    assert whole["result"] == "".join(tokens)
    turns = {"messages": [{"role": "user", "content": QUESTION},
                          {"role": "assistant", "content": "Paris."},
                          {"role": "user", "content": "And of Italy?"}],
             "temperature": 0, "max_dec_len": 24}
    assert requests.post(url, json=turns, timeout=120).json()["error_code"] == 0


@pytest.mark.parametrize("base", ["/v1", "/v1/chat/completions"])
def test_openai_sdk_chat_on_both_base_urls(default_server, base):
    client = openai.OpenAI(base_url=default_server.api + base, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="smollm2", messages=messages,
                                           temperature=0, max_tokens=24)
    assert "Paris" in whole.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=24, stream=True))
    assert streamed == whole.choices[0].message.content
    completion = client.completions.create(model="smollm2", prompt="The capital of France is",
                                           temperature=0, max_tokens=8)
    assert completion.usage.completion_tokens <= 8


def test_triton_generate_with_the_default_model(default_server):
    out = httpx.post(default_server.api + "/v2/models/ensemble/generate",
                     json={"text_input": "The capital of France is", "max_tokens": 8},
                     timeout=120).json()
    assert out["text_output"].startswith("The capital of France is")
    assert "Paris" in out["text_output"]


def test_tritonclient_seed_model_answers(default_server):
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{default_server.ports['grpc']}")
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    request = grpcclient.InferInput("IN", [1], "BYTES")
    request.set_data_from_numpy(np.array([json.dumps(
        [{"text": QUESTION, "max_dec_len": 24, "temperature": 0}]).encode()], dtype=object))
    client.async_stream_infer("model", [request], request_id="q-1")
    text = ""
    while True:
        result, error = answers.get(timeout=120)
        assert error is None
        text += json.loads(result.as_numpy("OUT")[0])[0]["token"]
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    assert "Paris" in text


def test_the_shipped_tools_template_gives_the_default_model_tool_calls(tmp_path):
    """The bundled model's own template renders no tools; with the ChatML template the repo
    ships (examples/), its <tool_call> format picks the hermes parser: a required call
    follows the tool's schema, and auto is served without --tool-call-parser."""
    import pathlib

    template = pathlib.Path(__file__).parents[2] / "examples" / "tool_chat_template_chatml.jinja"
    served = Served("", tmp_path, "--max-model-len", "1024", "--chat-template", str(template))
    served.args.remove("")
    served.args[served.args.index("tiny")] = "smollm2"
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}}}
    messages = [{"role": "system", "content": "You help with the weather."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    with served.running(timeout=300):
        client = openai.OpenAI(base_url=served.api + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="smollm2", messages=messages,
                                             tools=[weather], tool_choice="required",
                                             max_tokens=64, temperature=0)
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city"}
        history = messages + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": "get_weather", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "14 C and sunny"}]
        auto = client.chat.completions.create(model="smollm2", messages=history,
                                              tools=[weather], max_tokens=16, temperature=0)
        assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
        rendered = httpx.post(served.api + "/tokenize", json={
            "model": "smollm2", "messages": history, "return_token_strs": True}, timeout=60)
        assert rendered.status_code == 200
    assert b"tool calls: the hermes parser" in served.process.stdout.read()
