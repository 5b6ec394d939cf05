"""Logs: one access line per request, HTTP and gRPC (id, route, status, prompt and output
tokens, TTFT, total time) whose counts equal the response's usage, streams included; probes
not logged;
the prompt and output text only with --log-requests; `--log-format json`: every line of a
real `tokenmill serve` run parses, lifecycle lines included."""

import json
import logging

import httpx

from tests.serving import Served, service_thread
from tokenmill.logs import JsonFormatter


def _lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tokenmill.access"]


def test_access_lines_count_what_the_response_says(server, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.access")
    body = {"model": "tiny", "prompt": "Paris is", "max_tokens": 5, "n": 2}
    usage = httpx.post(server + "/v1/completions", json=body,
                       headers={"x-request-id": "abc-1"}).json()["usage"]
    with httpx.stream("POST", server + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines()
                  if x.startswith("data: {")]
    streamed = events[-1]["usage"]
    httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "x", "n": 99})
    httpx.get(server.replace("/v1", "") + "/health")
    lines = _lines(caplog)
    assert [(r.route, r.status) for r in lines] == [
        ("/v1/completions", 200), ("/v1/chat/completions", 200), ("/v1/completions", 400)]
    first, chat, bad = lines
    assert first.request_id == "abc-1" and len(chat.request_id) == 32
    assert (first.prompt_tokens, first.output_tokens) == (usage["prompt_tokens"],
                                                         usage["completion_tokens"])
    assert (chat.prompt_tokens, chat.output_tokens) == (streamed["prompt_tokens"],
                                                        streamed["completion_tokens"])
    assert 0 < first.ttft_s <= first.total_s
    assert (bad.prompt_tokens, bad.output_tokens, bad.ttft_s) == (0, 0, None)
    assert not any(hasattr(r, "prompt") or "Paris" in r.getMessage() for r in lines)
    parsed = json.loads(JsonFormatter().format(first))
    assert parsed["route"] == "/v1/completions" and parsed["level"] == "INFO"
    assert parsed["output_tokens"] == usage["completion_tokens"]


def test_log_requests_adds_the_text(engine_address, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.access")
    path, address = engine_address
    with service_thread(path, address, max_dec_len=64, log_requests=True) as thread:
        out = httpx.post(thread.base + "/v1/completions", json={
            "model": "tiny", "prompt": "Paris is", "max_tokens": 4}).json()
        # streamed: the engine hands out deltas; the log still gets the whole text
        with httpx.stream("POST", thread.base + "/v1/completions", json={
                "model": "tiny", "prompt": "Paris was", "max_tokens": 6, "stream": True}) as r:
            streamed = "".join(json.loads(x[6:])["choices"][0]["text"] for x in r.iter_lines()
                               if x.startswith("data: {"))
    whole, stream = _lines(caplog)
    assert whole.prompt == ["Paris is"] and whole.output == [out["choices"][0]["text"]]
    assert stream.prompt == ["Paris was"] and stream.output == [streamed] and streamed


def test_json_log_format_of_a_real_server(tiny_models, tmp_path):
    import numpy as np
    import tritonclient.grpc as grpcclient

    served = Served(tiny_models("llama")[0], tmp_path, "--log-format", "json")
    with served.running():
        httpx.post(served.api + "/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                         "max_tokens": 2})
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"),
                  grpcclient.InferInput("max_tokens", [1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([b"hello"], dtype=object))
        inputs[1].set_data_from_numpy(np.array([3], dtype=np.int32))
        client.infer("ensemble", inputs, request_id="g-1")
        client.close()
    lines = [json.loads(x) for x in served.process.stdout.read().decode().splitlines()
             if x.strip()]
    messages = " | ".join(x["message"] for x in lines)
    assert all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    for part in ("loading", "tokenmill serving", "tokenmill stopped"):
        assert part in messages, messages[-2000:]
    access, grpc = [x for x in lines if x["logger"] == "tokenmill.access"]
    assert access["route"] == "/v1/completions" and access["output_tokens"] == 2
    assert (grpc["method"], grpc["route"], grpc["status"]) == ("GRPC", "ModelInfer ensemble",
                                                               "OK")
    assert grpc["request_id"] == "g-1" and grpc["output_tokens"] == 3
