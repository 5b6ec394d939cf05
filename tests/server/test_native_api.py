"""The seed's native API, spoken the way the seed's own client snippets do (requests)."""

import json
import threading

import requests

from tests.serving import HOLD_TOKENS, wait_until
from tokenmill import LLM, SamplingParams


def stream_lines(server, body, path="/v1/chat/completions"):
    with requests.post(server + path, json={**body, "stream": True}, stream=True,
                       timeout=60) as resp:
        assert resp.status_code == 200
        return [json.loads(line) for line in resp.iter_lines() if line]


def test_streamed_text_equals_non_streamed_and_offline(server, engine_address):
    body = {"text": "The quick brown fox", "temperature": 0, "max_dec_len": 12,
            "req_id": "s-1"}
    lines = stream_lines(server, body)
    # send_idx counts the tokens of the lines before it, on every line; the seed's last line
    # carries no token, so its send_idx is the total.
    before = [sum(len(m["token_ids"]) for m in lines[:i]) for i in range(len(lines))]
    assert [m["send_idx"] for m in lines] == before
    assert lines[-1]["token"] == "" and lines[-1]["token_ids"] == []
    assert all(m["is_end"] == 0 and m["error_code"] == 0 and m["error_msg"] == ""
               for m in lines[:-1])
    last = lines[-1]
    assert last["is_end"] == 1 and last["req_id"] == "s-1"
    text = "".join(m["token"] for m in lines)
    ids = [t for m in lines for t in m["token_ids"]]
    assert text == last["tokens_all"] and ids == last["tokens_all_ids"]
    assert last["tokens_all_num"] == len(ids) == last["send_idx"]
    # Real per-token streaming: more than one message carries text.
    assert sum(1 for m in lines if m["token"]) > 1

    resp = requests.post(server + "/v1/chat/completions",
                         json={**body, "req_id": "s-2", "return_usage": True}, timeout=60)
    assert resp.status_code == 200
    result = resp.json()
    assert result["result"] == result["tokens_all"] == text and result["error_code"] == 0
    usage = result["usage"]
    assert usage["completion_tokens"] >= len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    # The same prompt through the offline API (chat template wraps text as a user turn).
    path, _ = engine_address
    llm = LLM(path, kv_cache_memory_gib=0.02)
    offline = llm.chat([{"role": "user", "content": "The quick brown fox"}],
                       SamplingParams(temperature=0, max_tokens=12, min_tokens=1),
                       use_tqdm=False)[0].outputs[0]
    assert offline.text == text


def test_multi_turn_messages_and_system(server):
    body = {"messages": [{"role": "user", "content": "Paris is"},
                         {"role": "assistant", "content": "the capital"},
                         {"role": "user", "content": "of what?"}],
            "system": "Answer briefly.", "temperature": 0, "max_dec_len": 6}
    first = requests.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    again = requests.post(server + "/v1/completions", json=body, timeout=60).json()
    assert first["error_code"] == 0 and first["result"] == again["result"]


def test_input_ids_and_stop_sequences(server):
    base = requests.post(server + "/v1/chat/completions",
                         json={"input_ids": [5, 17, 99, 200], "temperature": 0,
                               "max_dec_len": 16}, timeout=60).json()["result"]
    stop = base[len(base) // 2:len(base) // 2 + 2]
    lines = stream_lines(server, {"input_ids": [5, 17, 99, 200], "temperature": 0,
                                  "max_dec_len": 16, "stop_sequences": [stop]})
    text = "".join(m["token"] for m in lines)
    assert text == base[:base.index(stop)] == lines[-1]["tokens_all"]


def test_validation_errors_have_seed_texts_and_status(server):
    cases = [
        ({}, 400, "should contain either `text`, `input_ids` or `messages`"),
        ({"text": ""}, 400, "cannot be empty"),
        ({"text": 5, "model": "x"}, 400, "must be a string"),
        ({"text": "hi", "max_dec_len": 0}, 400, "`max_dec_len` must be an integer"),
        ({"text": "hi", "max_dec_len": 10_000}, 400, "exceeds the limit MAX_DEC_LEN(256)"),
        ({"text": "hi", "topp": 1.5}, 400, "`topp` must be in [0, 1]"),
        ({"text": "hi", "temperature": -1}, 400, "`temperature` must be >= 0"),
        ({"text": "hi", "stream": "yes"}, 400, "`stream` must be a boolean"),
        ({"text": "hi", "eos_token_ids": ["x"]}, 400, "eos token id should be integer"),
        ({"input_ids": [3] * 450}, 400, "exceeds the limit MAX_SEQ_LEN(400)"),
        ({"messages": [{"role": "user"}]}, 400, "must include `content`"),
    ]
    for body, status, text in cases:
        if "text" not in body and "input_ids" not in body and "messages" not in body:
            body = {**body, "text": None}  # still a native body: `text` key present
        resp = requests.post(server + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == status, (body, resp.text)
        data = resp.json()
        assert text in data["error_msg"], (body, data)
        assert data["error_code"] == status and data["result"] == ""
        assert "Traceback" not in resp.text and "/" not in data["error_msg"].replace(
            "[0, 1]", "")


def test_duplicate_in_flight_req_id_is_409(long_server):
    server, engine = long_server.base, long_server.app.state.server.engine
    body = {"text": "block after block", "max_dec_len": HOLD_TOKENS, "min_dec_len": HOLD_TOKENS,
            "req_id": "dup", "temperature": 0, "stream": True}
    started, leave = threading.Event(), threading.Event()
    lines = []

    def first():  # reads the stream until the test is done with it, then leaves
        with requests.post(server + "/v1/chat/completions", json=body, stream=True,
                           timeout=60) as resp:
            for line in resp.iter_lines():
                if line:
                    lines.append(json.loads(line))
                    started.set()
                if leave.is_set():
                    return

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(30)
    resp = requests.post(server + "/v1/chat/completions", json={**body, "stream": False},
                         timeout=30)
    assert resp.status_code == 409 and "already exists" in resp.json()["error_msg"]
    # The first request was not disturbed: it goes on streaming tokens, no error among them.
    seen = len(lines)
    assert wait_until(lambda: len(lines) > seen + 10)
    leave.set()
    t.join(60)
    assert all("error_code" not in m or m["error_code"] == 0 for m in lines), lines[-1]
    assert lines[-1]["is_end"] == 0
    # Once its client has left, the id is free again.
    assert wait_until(lambda: engine.num_in_flight() == 0)
    again = requests.post(server + "/v1/chat/completions",
                          json={**body, "stream": False, "max_dec_len": 3, "min_dec_len": 3},
                          timeout=30)
    assert again.status_code == 200 and again.json()["req_id"] == "dup"


def test_disable_streaming_sends_one_final_message(engine_address):
    from tests.serving import ServerThread, api_settings, free_port
    from tokenmill.entrypoints.http.server import create_service_app

    path, address = engine_address
    settings = api_settings(path, address, max_dec_len=64, max_cached_task_num=8,
                            disable_streaming=True)
    with ServerThread(create_service_app(settings), free_port()) as thread:
        url = f"http://127.0.0.1:{thread.port}"
        body = {"text": "The quick brown fox", "temperature": 0, "max_dec_len": 12}
        lines = stream_lines(url, body)
        whole = requests.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert len(lines) == 1 and lines[0]["is_end"] == 1
    assert lines[0]["token"] == lines[0]["tokens_all"] == whole["result"]
    assert lines[0]["token_ids"] == lines[0]["tokens_all_ids"]


def test_return_all_tokens_streams_only_the_last_message(server):
    body = {"text": "The quick brown fox", "temperature": 0, "max_dec_len": 12}
    streamed = stream_lines(server, body)
    lines = stream_lines(server, {**body, "return_all_tokens": True})
    assert len(lines) == 1 and lines[0]["is_end"] == 1
    assert lines[0]["token"] == lines[0]["tokens_all"] == streamed[-1]["tokens_all"]


def test_timeout_between_messages_ends_the_request(server, server_thread):
    # 1 ms is shorter than any round trip through the engine: the first wait times out.
    body = {"text": "slow", "max_dec_len": 200, "min_dec_len": 200, "timeout": 0.001}
    resp = requests.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 504 and "Timed out" in resp.json()["error_msg"]
    lines = stream_lines(server, body)
    assert lines[-1]["error_code"] == 504
    engine = server_thread.app.state.server.engine
    assert wait_until(lambda: engine.num_in_flight() == 0 and engine.stats.num_running == 0)


def test_internal_errors_are_500_without_details(engine_address):
    from tests.serving import ServerThread, api_settings, free_port
    from tokenmill.entrypoints.http.server import create_service_app

    class BrokenTokenizer:
        chat_template = None

        def __len__(self):
            return 1000

        def encode(self, *args, **kwargs):
            raise RuntimeError("secret detail in /home/user/model")

    path, address = engine_address
    settings = api_settings(path, address, max_dec_len=64, max_cached_task_num=8)
    app = create_service_app(settings)
    with ServerThread(app, free_port()) as thread:
        app.state.server.tokenizer = app.state.server.prompts.tokenizer = BrokenTokenizer()
        url = f"http://127.0.0.1:{thread.port}"
        for path_, body in (("/v1/chat/completions", {"text": "hi"}),
                            ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
            resp = requests.post(url + path_, json=body, timeout=30)
            assert resp.status_code == 500
            assert resp.json()["error_code"] == 500
            assert resp.json()["error"]["message"] == "Internal server error."
            assert "secret" not in resp.text and "Traceback" not in resp.text


def test_benchmark_fields_and_extra_eos_token(server):
    body = {"input_ids": [5, 17, 99, 200], "temperature": 0, "max_dec_len": 16,
            "benchmark": True}
    lines = stream_lines(server, body)
    assert all("inference_time_cost" in m and "http_received_time" in m for m in lines)
    ids = lines[-1]["tokens_all_ids"]
    assert len(ids) >= 3
    # Declaring a generated token (one not seen before it) an EOS ends the output right
    # before it.
    cut_at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    cut = requests.post(server + "/v1/chat/completions",
                        json={**body, "eos_token_ids": [ids[cut_at]], "stream": True},
                        stream=True, timeout=60)
    cut_lines = [json.loads(line) for line in cut.iter_lines() if line]
    assert cut_lines[-1]["tokens_all_ids"] == ids[:cut_at]
    assert cut_lines[-1]["finish_reason"] == "stop"
