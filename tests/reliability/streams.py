"""Streaming clients the fault tests drive: a streaming completion in a thread that leaves
when told (gracefully or by TCP RST), and a raw-socket stream the test closes itself."""

import json
import socket
import struct
import threading
import time

import httpx

from tests.reliability.checks import sse_events

COMPLETIONS = "/v1/completions"


def long_body(i: int, tokens: int = 400, **extra) -> dict:
    return {"model": "tiny", "prompt": f"story number {i}", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, **extra}


class Stream(threading.Thread):
    """One streaming completion in a thread; `leave_after` tokens, or `leave.set()`, then a
    graceful close (`rst=True`: an abortive close, TCP RST)."""

    def __init__(self, base: str, body: dict, leave_after: int | None = None,
                 rst: bool = False) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.leave_after, self.rst = base, body, leave_after, rst
        self.lines: list[str] = []
        self.started = threading.Event()
        self.leave = threading.Event()
        self.status, self.headers = None, None
        self.answered = threading.Event()  # the response's status line arrived
        self.wait_s: float | None = None  # from sending the request to its status line
        self.ended_at: float | None = None  # wall clock, when the stream closed

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.ended_at = time.time()

    def _run(self) -> None:
        if self.rst:
            return self._run_raw()
        sent = time.monotonic()
        with httpx.stream("POST", self.base + COMPLETIONS, json={**self.body, "stream": True},
                          timeout=120) as resp:
            self.status, self.wait_s = resp.status_code, time.monotonic() - sent
            self.headers = resp.headers
            self.answered.set()
            tokens = 0
            for line in resp.iter_lines():
                self.lines.append(line)
                if line.startswith("data: {"):
                    self.started.set()
                    tokens += 1
                if self.leave.is_set() or (self.leave_after is not None
                                           and tokens >= self.leave_after):
                    return
        self.started.set()

    def _run_raw(self) -> None:
        sock = open_raw_stream(self.base, self.body)
        received = b""
        while received.count(b"data: {") < (self.leave_after or 1):
            received += sock.recv(65536)
        self.started.set()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST

    def response(self) -> httpx.Response:
        """What came back, as one response (for a refusal's checks)."""
        return httpx.Response(self.status, headers=self.headers,
                              content="\n".join(self.lines).encode())

    def text(self) -> str:
        events, done = sse_events(self.lines)
        assert done == 1
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def leave_all(streams: list[Stream]) -> None:
    """The clients of accepted streams leave (waiting ones once they get their first
    token); every request ends and frees its slot."""
    for s in streams:
        s.leave.set()
    for s in streams:
        s.join(60)
        assert not s.is_alive() and s.status == 200


def open_raw_stream(base: str, body: dict) -> socket.socket:
    """A streaming request on a plain socket (so the test controls exactly when it closes)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def streaming(base: str, bodies: list[dict]) -> list[Stream]:
    """One Stream per body, each started and streaming when this returns."""
    streams = [Stream(base, body) for body in bodies]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60)
    return streams
