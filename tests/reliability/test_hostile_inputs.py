"""Inputs from a hostile pass over the Triton, native and OpenAI routes: every list capped,
every Triton input type- and range-checked, each route family's own error shape (401, 413,
431 included), messages and `req_id` validated before templating, known-but-unsupported
fields refused, and tokenizing / templating kept off the event loop the health answers share
(shown by a tokenizer that blocks until the test has had its health answer)."""

import logging
import socket
import threading

import httpx
import pytest

from tests.reliability.checks import assert_no_leak, assert_openai_error, blocking_tokenizer
from tests.serving import HOLD_TOKENS, service_thread, wait_until

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GENERATE = "/v2/models/ensemble/generate"


def triton(server, body, path=GENERATE, **kw):
    return httpx.post(server + path, json=body, timeout=60, **kw)


def assert_triton_error(resp, status: int, fragment: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert fragment in body["error"], body
    assert_no_leak(resp.text)


def assert_native_error(resp, status: int, fragment: str) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    body = resp.json()
    assert {"error_msg", "error_code"} <= set(body) and body["error_code"] == status, body
    assert fragment in body["error_msg"], body
    assert_no_leak(resp.text)
    return body


# Triton inputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,count", [("bad_words", 40_000), ("bad_words", 2_000),
                                        ("stop_words", 100_000)])
def test_triton_word_lists_are_capped_before_any_work(server, name, count):
    words = [f"w{i}" for i in range(count)]
    resp = triton(server, {"text_input": "hi", "max_tokens": 2, name: words})
    assert_triton_error(resp, 400, f"{name} may have at most 16 entries")
    long_word = triton(server, {"text_input": "hi", "max_tokens": 2, name: ["x" * 257]})
    assert_triton_error(long_word, 400, "at most 256 characters")
    assert triton(server, {"text_input": "hi", "max_tokens": 2,
                           name: words[:16]}).status_code == 200


@pytest.mark.parametrize("value", ["0.5", True, {"t": 1}, [1.0], -0.5])
def test_triton_temperature_is_checked_even_when_greedy(server, value):
    # no top_k / top_p: TensorRT-LLM's greedy, so the temperature is never used
    resp = triton(server, {"text_input": "hi", "max_tokens": 2, "temperature": value})
    assert_triton_error(resp, 400, "temperature")


@pytest.mark.parametrize("field,value", [
    ("top_p", 1.5), ("top_k", -1), ("top_p", "0.9"), ("min_tokens", -1), ("min_length", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
    ("pad_id", -1), ("seed", -1), ("length_penalty", "x"), ("beam_width", 0),
    ("beam_width", 17), ("num_return_sequences", 2),
])
def test_triton_inputs_are_type_and_range_checked(server, field, value):
    resp = triton(server, {"text_input": "hi", "max_tokens": 2, field: value})
    assert_triton_error(resp, 400, field)


# Error shapes -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(engine_address):
    path, address = engine_address
    with service_thread(path, address, max_dec_len=64, api_key="sesame",
                        max_request_body_bytes=4096) as thread:
        yield thread.base


def test_each_route_family_answers_401_and_413_in_its_own_shape(keyed):
    native = httpx.post(keyed + CHAT, json={"text": "hi", "req_id": "r1"}, timeout=30)
    body = assert_native_error(native, 401, "API key")
    assert body["req_id"] == "r1" and native.headers["www-authenticate"] == "Bearer"
    assert_openai_error(httpx.post(keyed + CHAT, json={"model": "tiny", "messages": []},
                                   timeout=30), 401)
    assert_triton_error(triton(keyed, {"text_input": "hi"}), 401, "API key")
    big = {"text_input": "x" * 5000}
    assert_triton_error(triton(keyed, big, headers={"authorization": "Bearer sesame"}), 413,
                        "larger than the limit")
    assert_triton_error(httpx.get(keyed + "/v2/nothing/here", timeout=30), 404, "Not Found")
    # Before the body is read, a shared path cannot tell the APIs apart: both shapes at once.
    shared = httpx.post(keyed + CHAT, json={"text": "x" * 5000}, timeout=30,
                        headers={"authorization": "Bearer sesame"})
    assert_openai_error(shared, 413)
    assert shared.json()["error_msg"].startswith("The request body is larger")


def test_headers_over_16_kib_are_431(server):
    headers = {f"x-h{i}": "v" * 1000 for i in range(20)}  # 20 KB of headers
    resp = httpx.get(server + "/health", headers=headers, timeout=30)
    assert resp.status_code == 431, resp.text
    small = {f"x-h{i}": "v" * 1000 for i in range(10)}
    assert httpx.get(server + "/health", headers=small, timeout=30).status_code == 200


# Native messages and req_id -------------------------------------------------------------------
@pytest.mark.parametrize("messages,where", [
    ([{"content": "hi"}], "`messages[0].role` must be a string"),
    ([{"role": "user", "content": "a"}, {"role": 5, "content": "hi"}],
     "`messages[1].role` must be a string"),
    ([{"role": "user", "content": 7}], "`messages[0].content` must be a string"),
    ([{"role": "user", "content": {"a": 1}}], "`messages[0].content` must be a string"),
    ([{"role": "user", "content": ["x"]}], "`messages[0].content` must be a string"),
    ([{"role": "user"}], "must include `content` (messages[0])"),
    (["hi"], "must be an object with `role` and `content` (messages[0])"),
])
def test_native_messages_are_checked_before_templating(server, messages, where):
    resp = httpx.post(server + CHAT, json={"messages": messages}, timeout=30)
    body = assert_native_error(resp, 400, where)
    assert "concatenate" not in body["error_msg"] and "object has no" not in body["error_msg"]


@pytest.mark.parametrize("req_id", [{"a": 1}, ["x"], True, 1.5])
def test_native_req_id_must_be_a_string(server, req_id):
    resp = httpx.post(server + CHAT, json={"text": "hi", "req_id": req_id}, timeout=30)
    body = assert_native_error(resp, 400, "`req_id` must be a string")
    assert body["req_id"] is None  # never echoed as a Python repr


def test_native_req_id_numbers_become_their_decimal_text(server):
    resp = httpx.post(server + CHAT, json={"text": "hi", "req_id": 42, "max_dec_len": 2},
                      timeout=30)
    assert resp.status_code == 200 and resp.json()["req_id"] == "42"
    resp = httpx.post(server + CHAT, json={"text": "hi", "req_id": None, "max_dec_len": 2},
                      timeout=30)
    assert resp.status_code == 200 and len(resp.json()["req_id"]) == 36  # a fresh UUID


# Context length messages ------------------------------------------------------------------------
def test_an_over_long_chat_prompt_reports_its_length(server, server_thread):
    limit = server_thread.app.state.server.max_model_len
    content = "The quick brown fox jumps over the lazy dog. " * 120  # ~1,200 tokens
    resp = httpx.post(server + CHAT, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": content}]})
    error = assert_openai_error(resp, 400, "messages")
    assert f"maximum context length is {limit} tokens" in error["message"]
    assert "your messages has" in error["message"] and "-" not in error["message"]
    n_in = int(error["message"].split("your messages has ")[1].split()[0])
    assert n_in > limit
    resp = httpx.post(server + CHAT, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600})
    error = assert_openai_error(resp, 400, "max_tokens")
    assert "600 in the completion" in error["message"]


def test_a_prompt_that_cannot_fit_is_refused_by_its_size_alone(server, server_thread):
    prompts = server_thread.app.state.server.prompts
    text = "a" * (prompts.max_chars + 1)
    for path, body in ((COMPLETIONS, {"model": "tiny", "prompt": text}),
                       (CHAT, {"model": "tiny", "messages": [{"role": "user",
                                                              "content": text}]})):
        assert "characters cannot fit" in assert_openai_error(
            httpx.post(server + path, json=body, timeout=60), 400)["message"]
    assert_native_error(httpx.post(server + CHAT, json={"text": text}, timeout=60), 400,
                        "characters cannot fit")
    assert_triton_error(triton(server, {"text_input": text}), 400, "characters cannot fit")


# Unsupported fields -------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("guided_whitespace_pattern", " "),
    ("functions", [{"name": "f"}]),
    ("priority", 200), ("priority", -1),  # (under --scheduling-policy fcfs, the default)
    ("lora_request", {"lora_name": "a", "lora_int_id": 1, "lora_path": "/x"}),
])
def test_known_unsupported_fields_are_refused_by_name(server, field, value):
    for path, body in ((COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                       (CHAT, {"model": "tiny", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]})):
        error = assert_openai_error(httpx.post(server + path, json={**body, field: value},
                                               timeout=30), 400, field)
        assert field in error["message"]
        unset = httpx.post(server + path, json={**body, field: None}, timeout=30)
        assert unset.status_code == 200, unset.text
    if field == "priority":  # vLLM's default priority asks for nothing: accepted
        default = httpx.post(server + COMPLETIONS, json={"model": "tiny", "prompt": "hi",
                                                         "max_tokens": 2, "priority": 0},
                             timeout=30)
        assert default.status_code == 200, default.text


# Off the event loop -------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["openai", "chat", "native", "native-messages", "triton"])
def test_long_inputs_are_tokenized_while_the_loop_answers(server, server_thread, route):
    text = "hello world " * 1000  # 12,000 characters: a worker thread's job
    body, path = {
        "openai": ({"model": "tiny", "prompt": text, "max_tokens": 1}, COMPLETIONS),
        "chat": ({"model": "tiny", "max_tokens": 1,
                  "messages": [{"role": "user", "content": text}]}, CHAT),
        "native": ({"text": text, "max_dec_len": 1}, CHAT),
        "native-messages": ({"messages": [{"role": "user", "content": text}],
                             "max_dec_len": 1}, CHAT),
        "triton": ({"text_input": text, "max_tokens": 1}, GENERATE),
    }[route]
    result = {}
    with blocking_tokenizer(server_thread) as tok:
        sender = threading.Thread(target=lambda: result.setdefault(
            "resp", httpx.post(server + path, json=body, timeout=120)))
        sender.start()
        assert tok.entered.wait(60), "the long input never reached the tokenizer"
        # The tokenizer is blocked inside this request: the loop must still answer.
        assert httpx.get(server + "/health", timeout=30).status_code == 200
        assert "resp" not in result
        tok.release.set()
        sender.join(120)
    assert result["resp"].status_code == 400  # 12k characters are over 512 tokens here


def test_many_messages_are_refused_at_once(server):
    messages = [{"role": "user", "content": ""}] * 60_000
    assert_openai_error(httpx.post(server + CHAT, timeout=60, json={
        "model": "tiny", "messages": messages}), 400, "messages")
    assert_native_error(httpx.post(server + CHAT, json={"messages": messages}, timeout=60),
                        400, "at most 2048 items")


# Quiet disconnects and counted rejections ------------------------------------------------
def test_a_client_leaving_mid_body_is_not_an_unhandled_error(server, caplog):
    host, port = server.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        assert httpx.get(server + "/health", timeout=30).status_code == 200
        assert wait_for_record(caplog, "client disconnected before its request body")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR
                or "unhandled" in r.getMessage()], caplog.text[-2000:]


def wait_for_record(caplog, text: str) -> bool:
    return wait_until(lambda: any(text in r.getMessage() for r in caplog.records), 30)


def test_refusals_are_counted_by_reason(long_server):
    metrics = long_server.metrics
    base = long_server.base

    def count(reason: str) -> float:
        return metrics.registry.get_sample_value("tokenmill:request_rejected_total",
                                                 {"model_name": "tiny", "reason": reason})

    reasons = ("invalid", "not_found", "too_large", "duplicate_id", "headers_too_large")
    before = {r: count(r) for r in reasons}
    assert None not in before.values()  # every reason is exported from the start
    httpx.post(base + COMPLETIONS, json={"model": "tiny", "prompt": "x", "n": 0}, timeout=30)
    httpx.post(base + COMPLETIONS, json={"model": "nope", "prompt": "x"}, timeout=30)
    httpx.post(base + COMPLETIONS, content=b"x" * (3 << 20), timeout=30)
    httpx.get(base + "/health", headers={"x-big": "v" * 20_000}, timeout=30)
    with httpx.stream("POST", base + CHAT, timeout=60, json={
            "text": "hold", "req_id": "dup", "stream": True, "max_dec_len": HOLD_TOKENS,
            "min_dec_len": HOLD_TOKENS}) as first:  # no early EOS: still running below
        lines = first.iter_lines()
        next(lines)  # running now
        again = httpx.post(base + CHAT, json={"text": "x", "req_id": "dup"}, timeout=30)
        assert again.status_code == 409
    assert {r: count(r) - before[r] for r in reasons} == dict.fromkeys(reasons, 1.0)


def test_the_size_bound_never_refuses_a_text_that_fits(tiny_models):
    """The characters a text of n tokens can have never exceed `max_prompt_chars(n)`, even
    for texts made of the vocabulary's longest tokens or of characters a normalizer folds."""
    from tokenmill.entrypoints.api.prompts import max_prompt_chars
    from tokenmill.loading.checkpoint import load_tokenizer
    from tokenmill.loading.gguf import default_model_path
    from tokenmill.loading.gguf_tokenizer import load_gguf_tokenizer

    for tok in (load_tokenizer(tiny_models("llama")[0]),
                load_gguf_tokenizer(default_model_path())):
        vocab = tok.get_vocab()
        longest = sorted(vocab, key=len)[-50:]
        texts = [tok.decode([vocab[t] for t in longest] * 20),
                 "e\u0301" * 3000, "\ufb01" * 3000, " " * 5000, "\U0001F600" * 2000,
                 "The quick brown fox jumps over the lazy dog. " * 200]
        for text in texts:
            n = len(tok.encode(text, add_special_tokens=False))
            assert len(text) <= max_prompt_chars(tok, n), (n, len(text), text[:40])


def test_token_strings_of_a_long_prompt_are_made_while_the_loop_answers(server,
                                                                         server_thread):
    """/tokenize with return_token_strs: a long prompt's token strings are made off the
    event loop (they held it for seconds: health, metrics and every request waited)."""
    state = server_thread.app.state.server
    entered, release = threading.Event(), threading.Event()
    real = state.tokenizer.convert_ids_to_tokens

    def blocking(ids, *args, **kwargs):
        if len(ids) > 1000:
            entered.set()
            release.wait(60)
        return real(ids, *args, **kwargs)

    state.tokenizer.convert_ids_to_tokens = blocking
    result = {}
    try:
        sender = threading.Thread(target=lambda: result.setdefault("resp", httpx.post(
            server + "/tokenize", json={"prompt": "hello world " * 400,
                                        "return_token_strs": True}, timeout=120)))
        sender.start()
        assert entered.wait(60), "the token strings were never made"
        assert httpx.get(server + "/health", timeout=30).status_code == 200
        assert "resp" not in result
        release.set()
        sender.join(120)
    finally:
        release.set()
        del state.tokenizer.convert_ids_to_tokens
    body = result["resp"].json()
    assert len(body["token_strs"]) == body["count"] > 1000


# JSON nesting -----------------------------------------------------------------------------------
def _nest(depth: int) -> str:
    """A value `depth` arrays and objects deep (alternating), ending in a string."""
    text = '"x"'
    for level in range(depth):
        text = f"[{text}]" if level % 2 else f'{{"a": {text}}}'
    return text


def _nested_schema(levels: int) -> str:
    text = '{"type": "string"}'
    for _ in range(levels):
        text = f'{{"type": "object", "properties": {{"a": {text}}}}}'
    return text


def _deep_bodies(depth: int) -> list[tuple[str, str]]:
    """Where the hostile pass nested its values: message content, tool-call arguments (as an
    object), a tool's parameters, native messages, /tokenize's messages."""
    deep = _nest(depth)
    tool = ('{"type": "function", "function": {"name": "f", "parameters": '
            + _nested_schema((depth - 1) // 2) + "}}")
    call = ('{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", '
            '"function": {"name": "f", "arguments": ' + deep + "}}]}")
    return [
        (CHAT, '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": '
               + deep + "}]}"),
        (CHAT, '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": '
               '"hi"}, ' + call + "]}"),
        (CHAT, '{"model": "tiny", "max_tokens": 2, "tool_choice": "required", "tools": ['
               + tool + '], "messages": '
               '[{"role": "user", "content": "hi"}]}'),
        (CHAT, '{"max_tokens": 2, "messages": [{"role": "user", "content": ' + deep + "}]}"),
        ("/tokenize", '{"model": "tiny", "messages": [{"role": "user", "content": '
                      + deep + "}]}"),
    ]


@pytest.mark.parametrize("depth", [129, 600, 900])
def test_json_nested_past_the_limit_is_400_at_parse_time_and_one_log_line(server, caplog,
                                                                          depth):
    for path, raw in _deep_bodies(depth):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            resp = httpx.post(server + path, content=raw.encode(), timeout=30,
                              headers={"content-type": "application/json"})
        assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])
        assert "more than 128 levels deep" in resp.text, resp.text
        assert_no_leak(resp.text)
        assert len(caplog.text) < 2000, caplog.text[:2000]


def test_json_nested_just_within_the_limit_is_never_a_500(server, caplog):
    # The bound is what the code after the parser survives: at 128 levels every route
    # answers (a 400 for a value of the wrong type, or 200), and the log stays short.
    for path, raw in _deep_bodies(128):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            resp = httpx.post(server + path, content=raw.encode(), timeout=60,
                              headers={"content-type": "application/json"})
        assert resp.status_code in (200, 400), (path, resp.status_code, resp.text[:300])
        assert_no_leak(resp.text)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
    still = httpx.post(server + COMPLETIONS, json={"model": "tiny", "prompt": "hi",
                                                   "max_tokens": 2}, timeout=30)
    assert still.status_code == 200
