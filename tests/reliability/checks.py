"""Assertions every reliability test shares: the one error shape (P4) and no leaks (S5)."""

import contextlib
import json
import re
import threading

# Absolute paths, tracebacks and object addresses never belong in a response body.
_LEAKS = re.compile(r"Traceback|File \"|/home/|/tmp/|/work/|/usr/|site-packages| at 0x")


def assert_no_leak(text: str, *secrets: str) -> None:
    assert not _LEAKS.search(text), text[:500]
    for secret in secrets:
        assert secret not in text


def assert_openai_error(resp, status: int, param: str | None = "?") -> dict:
    """`{"error": {"message": str, "type": str, "param": str|null, "code": str|int|null}}`
    with the expected status (and `param`, unless "?"); returns the error object. An error
    sent before the body was read (413, 408, 431) on a path the native API shares also
    carries the native `error_msg` / `error_code`, equal to the OpenAI fields."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) in ({"error"}, {"error", "error_msg", "error_code"}), body
    error = body["error"]
    if "error_msg" in body:
        assert (body["error_msg"], body["error_code"]) == (error["message"], status), body
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], (str, int))
    if param != "?":
        assert error["param"] == param, error
    assert_no_leak(resp.text)
    if status == 503:
        assert resp.headers.get("retry-after"), resp.headers
    return error


def sse_events(lines) -> tuple[list[dict], int]:
    """Parses an SSE body strictly (every data line is JSON or [DONE]); returns the JSON
    events and how many [DONE] markers came."""
    events, done = [], 0
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            done += 1
            continue
        assert done == 0, "event after [DONE]"
        events.append(json.loads(data))
    return events, done


@contextlib.contextmanager
def engine_calls(server_thread):
    """Records every request a service app (in this process) hands its engine: a refusal
    "before any work" is one that leaves this list empty, however slow the machine."""
    engine = server_thread.app.state.server.engine
    calls: list = []
    original = engine.generate

    def recording(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    engine.generate = recording
    try:
        yield calls
    finally:
        del engine.generate  # the class's method again


class BlockingTokenizer:
    """Delegates to the real tokenizer; a long encode waits until the test releases it."""

    def __init__(self, real) -> None:
        self.real = real
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text, *args, **kwargs):
        if len(text) > 8192:
            self.entered.set()
            self.release.wait(60)
        return self.real.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __len__(self):
        return len(self.real)


@contextlib.contextmanager
def blocking_tokenizer(server_thread):
    prompts = server_thread.app.state.server.prompts
    real = prompts.tokenizer
    prompts.tokenizer = blocking = BlockingTokenizer(real)
    try:
        yield blocking
    finally:
        blocking.release.set()
        prompts.tokenizer = real
