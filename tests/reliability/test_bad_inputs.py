"""Catalogue B2-B11: hostile or broken requests get a 400-class answer in the API's error
shape, never a 500, and the server keeps serving everyone else."""

import json
import socket
import threading

import httpx
import pytest

from tests.reliability.checks import (
    assert_no_leak,
    assert_openai_error,
    blocking_tokenizer,
    engine_calls,
    sse_events,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "temperature": 0}


def post(server, path, body=None, content=None, headers=None, timeout=30):
    return httpx.post(server + path, json=body, content=content, headers=headers,
                      timeout=timeout)


def still_serving(server) -> None:
    resp = post(server, COMPLETIONS, OK_BODY)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


# B3 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [
    b"{", b'""', b"[1]", b"42", b"null", b'"x"', b'{"prompt": "x"} trailing', b"",
    b"[" * 1000 + b"]" * 1000, b'{"a":' * 1000 + b"1" + b"}" * 1000,
    b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
    b'{"model": "tiny", "prompt": "x", "top_p": Infinity}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": -Infinity}',
    b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"a=1&b=2",
])
def test_malformed_json_is_400(server, raw):
    for path in (COMPLETIONS, CHAT):
        resp = post(server, path, content=raw, headers={"content-type": "application/json"})
        assert_openai_error(resp, 400)


def test_duplicate_keys_take_the_last_and_wrong_content_type_is_read_as_json(server):
    # Documented leniency: the body must be a JSON object whatever Content-Type says (curl -d
    # sends form-urlencoded); duplicate keys follow JSON parsers' last-wins rule.
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 50, "max_tokens": 2}'
    resp = post(server, COMPLETIONS, content=body, headers={"content-type": "text/plain"})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


# B4 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,field,value", [
    (CHAT, "messages", "str"), (COMPLETIONS, "max_tokens", "10"),
    (COMPLETIONS, "temperature", True), (COMPLETIONS, "stop", 5), (COMPLETIONS, "n", 1.5),
    (COMPLETIONS, "stream", "yes"), (COMPLETIONS, "prompt", {"a": 1}),
    (COMPLETIONS, "seed", "x"), (CHAT, "logprobs", "yes"), (COMPLETIONS, "logit_bias", []),
])
def test_wrong_types_name_the_field(server, path, field, value):
    body = {"model": "tiny", "max_tokens": 2, **({"messages": [{"role": "user", "content": "hi"}]}
                                                   if path == CHAT else {"prompt": "x"})}
    body[field] = value
    assert_openai_error(post(server, path, body), 400, field)


# B5 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0), ("top_p", 1.1), ("top_k", -2), ("max_tokens", 0),
    ("max_tokens", -1), ("max_tokens", 2**63), ("n", 0), ("n", 10**6),
    ("frequency_penalty", 2.1), ("presence_penalty", -2.1), ("min_tokens", 5),
    ("logprobs", 1000), ("min_p", 1.5), ("repetition_penalty", 0),
])
def test_out_of_range_params_are_400_naming_the_field(server, server_thread, field, value):
    body = {**OK_BODY, "max_tokens": 2, field: value}
    with engine_calls(server_thread) as calls:
        error = assert_openai_error(post(server, COMPLETIONS, body), 400)
    assert error["param"] == field, error
    assert calls == []  # refused by validation, not by running anything


def test_huge_n_allocates_nothing_and_other_streams_go_on(server, server_thread):
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    stream_done, streaming = threading.Event(), threading.Event()
    got = []

    def stream():
        with httpx.stream("POST", server + COMPLETIONS, timeout=60,
                          json={**OK_BODY, "max_tokens": 40, "ignore_eos": True,
                                "stream": True}) as resp:
            for line in resp.iter_lines():
                got.append(line)
                streaming.set()
        stream_done.set()

    worker = threading.Thread(target=stream)
    worker.start()
    # (measured from the stream's first event and after as many refusals: the server's
    # first requests grow it once, ~0.8 MB each for the first few whatever their error, and
    # that warm-up is not what this measures)
    assert streaming.wait(60)
    for _ in range(20):
        assert_openai_error(post(server, COMPLETIONS, {**OK_BODY, "n": 10**6}), 400, "n")
    before = me.memory_info().rss
    for _ in range(20):
        assert_openai_error(post(server, COMPLETIONS, {**OK_BODY, "n": 10**6}), 400, "n")
    assert me.memory_info().rss - before < 5 * 2**20
    worker.join(60)
    events, done = sse_events(got)
    assert done == 1 and events[-1]["choices"][0]["finish_reason"] == "length"


# B6 -----------------------------------------------------------------------------------------
def test_context_limits_at_the_boundary(server, server_thread):
    state = server_thread.app.state.server
    max_len = state.max_model_len  # 512 in the fixture
    ids = [5] * (max_len - 1)
    ok = post(server, COMPLETIONS, {"model": "tiny", "prompt": ids, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    error = assert_openai_error(post(server, COMPLETIONS, {"model": "tiny", "prompt": [5] * max_len,
                                                           "max_tokens": 1}), 400)
    assert "maximum context length" in error["message"] and error["param"] == "prompt"
    error = assert_openai_error(post(server, COMPLETIONS, {"model": "tiny", "prompt": ids,
                                                           "max_tokens": 2}), 400)
    assert "maximum context length" in error["message"] and error["param"] == "max_tokens"


def test_huge_prompt_is_refused_without_blocking_the_event_loop(server, server_thread):
    """~2 MB, just under the body limit (~340k tokens): refused by its size alone, so the
    tokenizer never runs on it (the body itself is parsed off the event loop)."""
    text = "hello world " * 170_000
    with blocking_tokenizer(server_thread) as tok:
        resp = post(server, COMPLETIONS, {"model": "tiny", "prompt": text, "max_tokens": 1},
                    timeout=120)
        assert not tok.entered.is_set()
    error = assert_openai_error(resp, 400, "prompt")
    assert "maximum context length" in error["message"]
    assert "characters cannot fit" in error["message"]


# B7 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,extra,param", [
    (COMPLETIONS, {"prompt": [-1]}, "prompt"), (COMPLETIONS, {"prompt": [10**7]}, "prompt"),
    (COMPLETIONS, {"prompt": [[-1]]}, "prompt"), (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"999999": 5}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_token_id_inputs(server, path, extra, param):
    assert_openai_error(post(server, path, {"model": "tiny", "max_tokens": 2, **extra}), 400,
                        param)
    still_serving(server)


def test_native_out_of_vocab_ids_are_refused_and_the_engine_survives(server):
    resp = post(server, COMPLETIONS, {"input_ids": [10**7], "max_dec_len": 2})
    assert resp.status_code == 400 and resp.json()["error_code"] == 400, resp.text
    assert_no_leak(resp.text)
    still_serving(server)


# B8 -----------------------------------------------------------------------------------------
def test_invalid_utf8_and_lone_surrogates_are_400(server):
    resp = post(server, COMPLETIONS, content=b'{"model":"tiny","prompt":"\xff\xfe","max_tokens":2}',
                headers={"content-type": "application/json"})
    assert_openai_error(resp, 400)
    resp = post(server, COMPLETIONS,
                content=b'{"model":"tiny","prompt":"a\\ud800b","max_tokens":2}',
                headers={"content-type": "application/json"})
    assert "surrogate" in assert_openai_error(resp, 400)["message"]
    paired = b'{"model":"tiny","prompt":"a\\ud83d\\ude00b","max_tokens":2}'  # a valid pair
    assert post(server, COMPLETIONS, content=paired).status_code == 200
    still_serving(server)


def test_nul_is_handled_consistently(server):
    body = {**OK_BODY, "prompt": "a\u0000b"}
    first, second = post(server, COMPLETIONS, body), post(server, COMPLETIONS, body)
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]


def test_streamed_deltas_are_whole_characters_equal_to_the_whole_text(server):
    # Emoji and CJK in the prompt; a random model emits byte-level pieces that split
    # characters across tokens: deltas must never carry a half character.
    body = {"model": "tiny", "prompt": "😀 漢字 ok", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    whole = post(server, COMPLETIONS, body).json()["choices"][0]["text"]
    with httpx.stream("POST", server + COMPLETIONS, json={**body, "stream": True},
                      timeout=60) as resp:
        raw = b"".join(resp.iter_bytes())
    text = raw.decode("utf-8")  # the whole stream is valid UTF-8
    events, done = sse_events(text.split("\n"))
    deltas = [e["choices"][0]["text"] for e in events if e.get("choices")]
    assert done == 1 and "".join(deltas) == whole
    for delta in deltas[:-1]:  # only the final flush may carry an incomplete sequence
        assert "\ufffd" not in delta or "\ufffd" in whole


# B9 -----------------------------------------------------------------------------------------
def test_req_id_reusable_after_completion_and_after_abort(long_server):
    from tests.serving import HOLD_TOKENS, wait_until

    state, server = long_server.app.state.server, long_server.base
    body = {"text": "hello", "req_id": "same-id", "max_dec_len": 3}
    for _ in range(2):  # after completion
        resp = post(server, CHAT, body)
        assert resp.status_code == 200 and resp.json()["error_code"] == 0, resp.text
    with httpx.stream("POST", server + CHAT, timeout=60,
                      json={**body, "max_dec_len": HOLD_TOKENS, "min_dec_len": HOLD_TOKENS,
                            "stream": True}) as resp:
        lines = resp.iter_lines()  # kept: a dropped line iterator closes the response
        next(lines)  # started; leaving aborts it
        assert state.engine.has_request("same-id")
    assert wait_until(lambda: not state.engine.has_request("same-id"), 60)
    resp = post(server, CHAT, body)
    assert resp.status_code == 200 and resp.json()["error_code"] == 0, resp.text


# B10 ----------------------------------------------------------------------------------------
def test_unknown_model(server):
    for path, body in ((COMPLETIONS, {"prompt": "x"}),
                       (CHAT, {"messages": [{"role": "user", "content": "x"}]})):
        assert_openai_error(post(server, path, {"model": "nope", "max_tokens": 2, **body}), 404,
                            "model")
    resp = post(server, "/v2/models/nope/generate", {"text_input": "x", "max_tokens": 2})
    assert resp.status_code == 404 and "error" in resp.json()
    assert httpx.get(server + "/v2/models/nope/ready", timeout=10).status_code in (400, 404)


# B11 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": ""}, "prompt"), (COMPLETIONS, {"prompt": []}, "prompt"),
    (CHAT, {"messages": []}, "messages"), (CHAT, {"messages": [{}]}, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_empty_inputs(server, path, body, param):
    assert_openai_error(post(server, path, {"model": "tiny", "max_tokens": 2, **body}), 400,
                        param)


def test_native_empty_inputs_use_the_seed_shape(server):
    for body in ({"text": ""}, {"messages": []}, {"messages": [{}]}):
        resp = post(server, CHAT, body)
        assert resp.status_code == 400 and resp.json()["error_code"] == 400, resp.text


# B2 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [
    b"GET\r\n\r\n", b"GET /\r\n\r\n", b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/2.0\r\n\r\n", b"GET / HTTP/0.9\r\n\r\n", b"\x00\x01\x02\x03\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{}",
    b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /%00%ff/../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
])
def test_http_line_fuzz_keeps_the_server_live(server, raw):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        reply = b""
        try:
            sock.sendall(raw)
            # The server may answer an over-long line and close (even reset) before the
            # client finishes: both ends of that race are the server refusing it.
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:  # timeouts, resets and ENOTCONN alike
            pass
    if reply:
        assert reply.startswith(b"HTTP/1.1 "), reply[:100]
        assert not reply.startswith(b"HTTP/1.1 5"), reply[:300]
        assert_no_leak(reply.decode("latin-1"))
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_error_events_in_a_stream_are_one_event_then_done(server):
    # Refused at validation: a plain JSON error (the stream never started).
    resp = post(server, COMPLETIONS, {**OK_BODY, "stream": True, "n": 0})
    assert_openai_error(resp, 400, "n")
    assert json.loads(resp.text)["error"]["code"] == 400


def test_stream_lines_cannot_be_split_by_unicode_line_breaks():
    """U+2028/U+2029/U+0085 in generated text: str.splitlines() (httpx's iter_lines) splits
    on them, so the server escapes them (found by the soak: a garbled SSE line)."""
    from tokenmill.entrypoints.http.streaming import json_line

    text = "a\u2028b\u2029c\x85d\x1c\x1d\x1e漢😀\n\r"
    line = json_line({"text": text})
    assert line.splitlines() == [line] and json.loads(line)["text"] == text
    assert "漢😀" in line  # everything else stays raw UTF-8


def test_banned_tokens_logprobs_are_json_numbers():
    """A banned token's -inf logprob (a top-logprobs alternative under a constraint or bad
    words) goes out as vLLM sends it, -9999.0, in chat and completion logprobs, and a
    stream line never holds a non-JSON token such as -Infinity."""
    from tokenmill.entrypoints.http.openai_logprobs import chat_logprobs, completion_logprobs
    from tokenmill.entrypoints.http.streaming import json_line
    from tokenmill.outputs import CompletionOutput, Logprob

    position = {7: Logprob(-0.25, 1, "a"), 9: Logprob(float("-inf"), 2, "b")}
    c = CompletionOutput(0, "a", [7], logprobs=[position])
    chat = chat_logprobs(c, 0, 1, 2)["content"][0]
    assert [t["logprob"] for t in chat["top_logprobs"]] == [-0.25, -9999.0]
    assert completion_logprobs(c, 0, 1, 0)["top_logprobs"] == [{"a": -0.25, "b": -9999.0}]
    assert json.loads(json_line({"x": float("-inf"), "y": float("nan")})) == \
        {"x": None, "y": None}


def test_largest_seed_with_several_samples(server):
    """Each of n samples gets seed + i, wrapped into the seed range (was a 500 at 2**64 - 1)."""
    body = {**OK_BODY, "temperature": 1.0, "seed": 2**64 - 1, "n": 2}
    first, second = post(server, COMPLETIONS, body), post(server, COMPLETIONS, body)
    assert first.status_code == 200, first.text
    assert [c["text"] for c in first.json()["choices"]] == \
        [c["text"] for c in second.json()["choices"]]


def test_a_single_long_stop_string_is_within_the_cap(server):
    assert post(server, COMPLETIONS, {**OK_BODY, "stop": "a" * 200}).status_code == 200
    assert_openai_error(post(server, COMPLETIONS, {**OK_BODY, "stop": "a" * 257}), 400, "stop")
