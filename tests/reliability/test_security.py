"""Catalogue S1-S6: API key on every inference route, size limits, template sandboxing,
no pickle on the network, no leaks in error bodies, caps on every fan-out knob."""

import ast
import contextlib
import copy
import pathlib
import socket
import threading
import time

import httpx
import pytest

from tests.reliability.checks import assert_no_leak, assert_openai_error, engine_calls
from tests.serving import ServerThread, free_port

KEY = "s3cret-Key"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
REPO = pathlib.Path(__file__).resolve().parents[2]


def app_over(engine_address, **config):
    from tests.serving import api_settings
    from tokenmill.entrypoints.http.server import create_service_app

    path, address = engine_address
    app = create_service_app(api_settings(path, address, **{
        "max_dec_len": 64, "max_cached_task_num": 16, **config}))
    return ServerThread(app, free_port())


@pytest.fixture(scope="module")
def keyed(engine_address):
    with app_over(engine_address, api_key=KEY) as thread:
        yield f"http://127.0.0.1:{thread.port}"


@pytest.fixture(scope="module")
def trusting(engine_address):
    with app_over(engine_address, trust_request_chat_template=True) as thread:
        yield f"http://127.0.0.1:{thread.port}"


INFERENCE = [
    ("POST", COMPLETIONS, {"model": "tiny", "prompt": "x", "max_tokens": 1}),
    ("POST", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 1}),
    ("POST", CHAT, {"text": "x", "max_dec_len": 1}),  # native
    ("POST", "/v1/chat/completions/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("POST", "/v2/models/tiny/generate", {"text_input": "x", "max_tokens": 1}),
    ("POST", "/v2/models/tiny/generate_stream", {"text_input": "x", "max_tokens": 1}),
    ("POST", "/v2/models/tiny/versions/1/generate", {"text_input": "x", "max_tokens": 1}),
]


# S1 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,body", INFERENCE)
def test_every_inference_route_needs_the_exact_key(keyed, method, path, body):
    for auth in (None, "Bearer wrong", f"Bearer {KEY.upper()}", f"Bearer {KEY.lower()}",
                 f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer"):
        headers = {"authorization": auth} if auth else {}
        resp = httpx.request(method, keyed + path, json=body, headers=headers, timeout=30)
        assert resp.status_code == 401, (auth, resp.status_code)
        assert resp.headers["www-authenticate"] == "Bearer"
        assert_no_leak(resp.text, KEY)
    for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive
        resp = httpx.request(method, keyed + path, json=body, timeout=30,
                             headers={"authorization": f"{scheme} {KEY}"})
        assert resp.status_code == 200, (scheme, resp.text)


def test_path_and_host_tricks_do_not_bypass_the_key(keyed):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    tricks = [("//v1/completions", {}), ("/%76%31/completions", {}),
              ("/v1/completions?", {"host": "localhost/v1/models?"}),
              ("/v1/./completions", {}), ("/v1/completions/", {}),
              ("/root/v1/completions", {}), ("/V1/COMPLETIONS", {})]
    for path, headers in tricks:
        host, port = keyed.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            raw = (f"POST {path} HTTP/1.1\r\nHost: {headers.get('host', host)}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(str(body))}\r\n"
                   "Connection: close\r\n\r\n").encode() + str(body).encode()
            sock.sendall(raw)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        status = int(reply.split(b" ", 2)[1])
        assert status in (401, 404, 400, 405), (path, reply[:200])


def test_probes_and_docs_stay_open_and_hold_no_secrets(keyed):
    for path in ("/health", "/v2/health/live", "/v2/health/ready", "/openapi.json"):
        resp = httpx.get(keyed + path, timeout=10)
        assert resp.status_code == 200, path
        assert_no_leak(resp.text, KEY)


def test_the_key_is_compared_in_constant_time_on_digests():
    source = (REPO / "tokenmill/entrypoints/auth.py").read_text()
    assert "hmac.compare_digest" in source and "sha256" in source
    for path in ("tokenmill/entrypoints/http/server.py",
                 "tokenmill/entrypoints/kserve/__init__.py"):
        text = (REPO / path).read_text()
        assert "ApiKey(" in text and "api_key ==" not in text and "== key" not in text
    from tokenmill.entrypoints.auth import ApiKey

    key = ApiKey(KEY)
    assert key.accepts(f"Bearer {KEY}") and key.accepts(f"bearer  {KEY} ")
    assert not key.accepts(None) and not key.accepts(f"Token {KEY}")
    assert not key.accepts("Bearer \udcff")  # undecodable bytes cannot crash the check


# S2 -----------------------------------------------------------------------------------------
def raw_request(base: str, head: bytes, body: bytes = b"", timeout: float = 10) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    reply = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        try:
            sock.sendall(head + body)
            while chunk := sock.recv(65536):
                reply += chunk
        except (TimeoutError, ConnectionResetError, BrokenPipeError):
            pass  # the server may close on us mid-send: what it answered (if any) is kept
    return reply


def test_body_limit_with_content_length_and_chunked(server):
    from tokenmill.entrypoints.api.json_body import DEFAULT_MAX_BODY_BYTES as limit

    def body_of(size: int) -> bytes:
        head = b'{"model": "tiny", "max_tokens": 1, "prompt": "'
        return head + b"a" * (size - len(head) - 2) + b'"}'

    at_limit = httpx.post(server + COMPLETIONS, content=body_of(limit), timeout=120)
    assert at_limit.status_code != 413 and at_limit.status_code < 500  # 400: too many tokens
    over = httpx.post(server + COMPLETIONS, content=body_of(limit + 1), timeout=60)
    assert "larger than the limit" in assert_openai_error(over, 413)["message"]

    def chunks():  # no Content-Length: counted as it arrives
        data = body_of(limit + 1)
        for i in range(0, len(data), 65536):
            yield data[i:i + 65536]

    chunked = httpx.post(server + COMPLETIONS, content=chunks(), timeout=60)
    assert_openai_error(chunked, 413)
    assert httpx.get(server + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("length", [b"abc", b"-1", b"1e3", b"5, 6"])
def test_bad_content_length_is_400(server, length):
    reply = raw_request(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                        + length + b"\r\nConnection: close\r\n\r\n", b"{}")
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]


def test_header_abuse(server):
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(300))
    reply = raw_request(server, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many +
                        b"Connection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    huge = b"X-Big: " + b"a" * (8 << 20) + b"\r\n"
    reply = raw_request(server, b"GET /health HTTP/1.1\r\nHost: x\r\n" + huge + b"\r\n")
    assert reply == b"" or reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), reply[:200]
    request_id = {"x-request-id": "r" * (1 << 20)}  # 1 MB: refused by the header parser
    try:
        resp = httpx.post(server + COMPLETIONS, json={"model": "tiny", "prompt": "x",
                                                      "max_tokens": 1},
                          headers=request_id, timeout=30)
        assert resp.status_code in (400, 431) and "r" * 1000 not in resp.text
    except httpx.TransportError:
        pass  # the server closed the connection on it: refused too
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_slow_body_times_out():
    """The body timeout (30 s by default) on a real uvicorn, shortened to 1 s."""
    from fastapi import FastAPI, Request

    from tokenmill.entrypoints.http.request_body import RequestLimitMiddleware

    app = FastAPI()
    app.add_middleware(RequestLimitMiddleware, body_timeout_s=1.0)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"n": len(await request.body())}

    with ServerThread(app, free_port()) as thread:
        base = f"http://127.0.0.1:{thread.port}"
        host, port = "127.0.0.1", thread.port
        start = time.monotonic()
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            reply = b""
            for _ in range(40):  # one byte every 0.1 s: 4 s for 40 bytes, never complete
                try:
                    sock.sendall(b"a")
                except OSError:
                    break
                sock.settimeout(0.1)
                with contextlib.suppress(TimeoutError):
                    reply += sock.recv(65536)
                if reply:
                    break
        # 408 after the 1 s set here, not the default 30 s: within the 40 bytes' >= 4 s.
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert time.monotonic() - start >= 1.0
        fast = httpx.post(base + "/echo", content=b"x" * 100, timeout=10)
        assert fast.json() == {"n": 100}


# S3 -----------------------------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "hi"}]


def test_request_chat_template_needs_the_trust_flag(server, trusting, engine_address):
    engine_path = engine_address[0]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1,
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    assert_openai_error(httpx.post(server + CHAT, json=body, timeout=30), 400, "chat_template")
    ok = httpx.post(trusting + CHAT, json=body, timeout=30)
    from tokenmill.loading.checkpoint import load_tokenizer

    want = len(load_tokenizer(engine_path).encode("hi", add_special_tokens=False))
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == want


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('touch /tmp/tokenmill-pwned').read() }}",
    "{% set x = [].append.__self__ %}{{ x.__class__ }}",
])
def test_template_escapes_are_sandboxed(trusting, template):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "chat_template": template}
    error = assert_openai_error(httpx.post(trusting + CHAT, json=body, timeout=30), 400)
    assert "not allowed" in error["message"] or "chat template" in error["message"]
    assert not pathlib.Path("/tmp/tokenmill-pwned").exists()


@pytest.mark.parametrize("kwargs,status", [
    ({"tokenize": True}, 400), ({"add_generation_prompt": False}, 400),
    ({"chat_template": "x"}, 400), ({"unknown": 1}, 400), ({"enable_thinking": {"a": 1}}, 400),
    ({"enable_thinking": False}, 200), ({}, 200),
])
def test_template_kwargs_allowlist(server, kwargs, status):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1,
            "chat_template_kwargs": kwargs}
    resp = httpx.post(server + CHAT, json=body, timeout=30)
    if status == 400:
        assert_openai_error(resp, 400, "chat_template_kwargs")
    else:
        assert resp.status_code == 200, resp.text


def test_message_content_is_data_not_template_code(engine_address):
    from tokenmill.loading.checkpoint import load_tokenizer
    from tokenmill.tokenizer import ChatTemplateError, apply_chat_template

    tokenizer = load_tokenizer(engine_address[0])
    payload = "{{ 7*7 }}{% for x in range(3) %}X{% endfor %}{{ self.__init__ }}"
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": payload}])
    text = tokenizer.decode(ids)
    assert payload in text and "49" not in text and "XXX" not in text
    evil = copy.deepcopy(tokenizer)
    evil.chat_template = "{{ messages.__class__.__base__.__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="not allowed"):
        apply_chat_template(evil, MESSAGES)


# S4 -----------------------------------------------------------------------------------------
_UNSAFE_CALLS = {("pickle", "loads"), ("pickle", "load"), ("cloudpickle", "loads"),
                 ("marshal", "loads"), ("yaml", "load"), ("dill", "loads")}


def test_no_unpickling_anywhere_in_the_package():
    """Static: nothing in tokenmill/ can turn bytes into code (pickle, marshal, unsafe yaml,
    torch.load without weights_only=True)."""
    found = []
    for path in (REPO / "tokenmill").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                if any(n.split(".")[0] in ("pickle", "cloudpickle", "dill", "marshal")
                       for n in names):
                    found.append(f"{path}: imports {names}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                name = (getattr(owner, "id", None), node.func.attr)
                if name in _UNSAFE_CALLS:
                    found.append(f"{path}:{node.lineno}: {name}")
                if name == ("torch", "load"):
                    safe = any(k.arg == "weights_only" and getattr(k.value, "value", None)
                               is True for k in node.keywords)
                    if not safe:
                        found.append(f"{path}:{node.lineno}: torch.load without weights_only")
    assert not found, found


# S5 / S6 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,param", [
    ("n", 17, "n"), ("best_of", 17, "best_of"), ("stop", ["s"] * 17, "stop"),
    ("stop", ["s" * 300], "stop"), ("bad_words", ["w"] * 17, "bad_words"),
    ("stop_token_ids", [1] * 17, "stop_token_ids"), ("logprobs", 21, "logprobs"),
    ("logit_bias", {str(i): 1 for i in range(1000)}, "logit_bias"),
    ("prompt", ["x"] * 33, "prompt"), ("n", 4, "n"),  # 32 prompts x 4 > 64 sequences
])
def test_fan_out_caps(server, server_thread, field, value, param):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1, field: value}
    if (field, value) == ("n", 4):
        body["prompt"] = ["x"] * 32
    with engine_calls(server_thread) as calls:
        assert_openai_error(httpx.post(server + COMPLETIONS, json=body, timeout=60), 400, param)
    assert calls == []  # refused before any work reached the engine


def test_chat_top_logprobs_cap(server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "logprobs": True,
            "top_logprobs": 21}
    assert_openai_error(httpx.post(server + CHAT, json=body, timeout=30), 400, "top_logprobs")


def test_native_caps_and_no_echo_of_huge_ids(server):
    resp = httpx.post(server + CHAT, json={"text": "x", "req_id": "r" * 100_000}, timeout=30)
    assert resp.status_code == 400 and "r" * 300 not in resp.text
    resp = httpx.post(server + CHAT, json={"text": "x", "stop_sequences": ["s"] * 17},
                      timeout=30)
    assert resp.status_code == 400 and "stop_sequences" in resp.json()["error_msg"]


def test_error_bodies_leak_nothing(server, engine_address, monkeypatch):
    cases = [(COMPLETIONS, {"model": "nope", "prompt": "x"}), (COMPLETIONS, {"prompt": 5}),
             (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [
                 {"type": "image_url",
                  "image_url": "file:///etc"}]}]}),
             ("/nowhere", {}), (COMPLETIONS, {"model": "tiny", "prompt": [10**9]})]
    for path, body in cases:
        resp = httpx.post(server + path, json=body, timeout=30)
        assert 400 <= resp.status_code < 500, (path, resp.status_code)
        assert_no_leak(resp.text, engine_address[0])
    # A 500 from an internal fault: one sentence, nothing else.
    with app_over(engine_address) as thread:
        from tokenmill.entrypoints.http import openai_api

        def boom(*args, **kwargs):
            raise RuntimeError(f"secret detail at {engine_address[0]} object at 0x7f00")

        monkeypatch.setattr(openai_api, "create_completion", boom)
        resp = httpx.post(f"http://127.0.0.1:{thread.port}{COMPLETIONS}",
                          json={"model": "tiny", "prompt": "x"}, timeout=30)
        assert resp.status_code == 500
        assert_no_leak(resp.text, engine_address[0], "secret detail")


def test_concurrent_garbage_does_not_disturb_a_stream(server):
    """Bad requests in a loop while a stream runs: the stream completes intact."""
    lines = []

    def stream():
        with httpx.stream("POST", server + COMPLETIONS, timeout=60,
                          json={"model": "tiny", "prompt": "x", "max_tokens": 60,
                                "ignore_eos": True, "stream": True}) as resp:
            lines.extend(resp.iter_lines())

    worker = threading.Thread(target=stream)
    worker.start()
    for body in ([1], {"n": 0}, {"prompt": 5}, "x") * 10:
        httpx.post(server + COMPLETIONS, json=body, timeout=30)
    worker.join(60)
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


# Every port bounds the request head -------------------------------------------------------------
def _port_apps():
    """The health port's and the metrics port's apps (the dashboard's too), as serve builds
    them; the API port is the `server` fixture."""
    from prometheus_client import CollectorRegistry

    from tokenmill.entrypoints.http.dashboard import metrics_app
    from tokenmill.entrypoints.http.server import create_health_app

    return {"health": (create_health_app(lambda: None), "/v2/health/live"),
            "metrics": (metrics_app(CollectorRegistry()), "/metrics")}


def _send_huge_header(port: int, path: str, total: int = 32 << 20) -> tuple[int, bytes]:
    """Sends one header of `total` bytes in 64 KiB pieces until the server stops reading;
    returns how much was sent and what came back."""
    sent, reply = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.settimeout(10)
        try:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode())
            piece = b"a" * 65536
            while sent < total:
                sock.sendall(piece)
                sent += len(piece)
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            pass
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while chunk := sock.recv(65536):
                reply += chunk
    return sent, reply


@pytest.mark.parametrize("name", ["health", "metrics", "api"])
def test_every_port_refuses_a_huge_header_as_it_arrives(server, name):
    if name == "api":
        port, path = int(server.rsplit(":", 1)[1]), "/health"
        context = contextlib.nullcontext()
    else:
        app, path = _port_apps()[name]
        port = free_port()
        context = ServerThread(app, port)
    with context:
        sent, reply = _send_huge_header(port, path)
        # refused after 16 KiB and a chunk, long before 32 MiB (what the kernel's socket
        # buffers took in the meantime is all that was sent)
        assert sent < (16 << 20), sent
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
        assert b"larger than" in reply
        assert httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10).status_code == 200


@pytest.mark.parametrize("name", ["health", "metrics"])
def test_every_port_times_out_a_head_that_trickles(monkeypatch, name):
    from tokenmill.entrypoints.http.connection import BoundedHttpProtocol

    monkeypatch.setattr(BoundedHttpProtocol, "head_timeout_s", 1.0)
    app, path = _port_apps()[name]
    with ServerThread(app, free_port()) as thread:
        with socket.create_connection(("127.0.0.1", thread.port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode())
            reply = b""
            for _ in range(100):  # a header byte every 0.1 s: never complete, bounded loop
                try:
                    sock.sendall(b"X")
                except (ConnectionResetError, BrokenPipeError):
                    break
                sock.settimeout(0.1)
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                reply += chunk
                if not chunk or reply.endswith(b"}"):
                    break
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        with socket.create_connection(("127.0.0.1", thread.port), timeout=10) as idle:
            idle.settimeout(10)  # a connection that sends nothing is closed too
            assert idle.recv(65536).startswith(b"HTTP/1.1 408")
        assert httpx.get(f"http://127.0.0.1:{thread.port}{path}", timeout=10).status_code == 200


def test_a_body_is_never_counted_as_the_head(server):
    """The head is counted chunk by chunk while it arrives: a body written after it (in one
    large write, the last chunk ending the message) must not be taken for head bytes."""
    body = b'{"model": "tiny", "max_tokens": 1, "prompt": "' + b"hi " * 40_000 + b'"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        time.sleep(0.2)  # (two writes, so the body arrives in chunks of its own)
        sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]  # the prompt is over the context
    assert b"maximum context length" in reply
