"""Request bodies: size and time limits enforced before any handler parses a byte, and the
one JSON parser every HTTP route uses.

An ASGI middleware rather than a check in the handlers: a declared `Content-Length` over the
limit is refused before the body is read, a chunked body is counted as it arrives and cut off
at the limit, and a body that trickles in (slowloris) is refused when its time is up, so
neither memory nor a handler is spent on it. Errors are JSON in the shape of the path's route
family (`error_json`)."""

from __future__ import annotations

import asyncio
import json
import time

from tokenmill.entrypoints.api.json_body import DEFAULT_MAX_BODY_BYTES, parse_json_object
from tokenmill.entrypoints.api.offload import off_loop_if

DEFAULT_BODY_TIMEOUT_S = 30.0
# Header count and bytes (names and values, as docs/reliability.md promises): uvicorn's
# httptools parser has no byte limit of its own, h11's answers 400 past 16 KiB.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 16 * 1024


class _BodyTooLarge(Exception):
    pass


class _BodyTimeout(Exception):
    pass


def error_json(message: str, status: int, path: str = "") -> bytes:
    """An error before the body was parsed, in the shape of the route family `path` belongs
    to: Triton's `{"error": message}` under /v2/, else OpenAI's error object with the native
    API's `error_msg` / `error_code` beside it (both APIs share their paths, and which one a
    request speaks is only known from its body)."""
    from tokenmill.entrypoints.http.openai_errors import error_body

    if path.startswith("/v2/"):
        return json.dumps({"error": message}).encode()
    if path.startswith("/v1/messages"):  # (Anthropic's Messages API)
        from tokenmill.entrypoints.api.anthropic_protocol import error_body as anthropic

        return json.dumps(anthropic(message, status)).encode()
    return json.dumps({**error_body(message, status), "error_msg": message,
                       "error_code": status}).encode()


async def send_json_error(send, status: int, message: str, path: str = "",
                          headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = error_json(message, status, path)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


UPLOAD_TIMEOUT_S = 600.0  # (a file upload's body may take this long to arrive)


class RequestLimitMiddleware:
    """431 for more than MAX_HEADERS headers or MAX_HEADER_BYTES of them, 413 for bodies over
    `max_body_bytes` (declared or counted), 400 for a malformed `Content-Length`, 408 when the
    body is not complete `body_timeout_s` after the request started. After the body is
    complete, `receive` is passed through untouched (streaming handlers wait on it for the
    client's disconnect)."""

    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 uploads: dict[str, int] | None = None) -> None:
        """`uploads`: paths whose POST bodies are files, with their own limit (and
        UPLOAD_TIMEOUT_S to arrive)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.uploads = uploads or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if len(scope["headers"]) > MAX_HEADERS:
            return await send_json_error(send, 431, f"More than {MAX_HEADERS} request headers.",
                                         path)
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            return await send_json_error(send, 431, "The request headers are larger than "
                                         f"{MAX_HEADER_BYTES // 1024} KiB.", path)
        max_bytes, timeout = self.max_body_bytes, self.body_timeout_s
        if scope.get("method") == "POST" and path in self.uploads:
            max_bytes, timeout = self.uploads[path], max(timeout, UPLOAD_TIMEOUT_S)
        lengths = [v for k, v in scope["headers"] if k == b"content-length"]
        if lengths:
            text = lengths[0].decode("latin-1").strip()
            if len(set(lengths)) > 1 or not text.isdigit():
                return await send_json_error(send, 400, "Invalid Content-Length header.", path)
            if int(text) > max_bytes:
                return await send_json_error(send, 413, self._too_large(max_bytes), path)
        deadline = time.monotonic() + timeout
        received, body_done, started = 0, False, False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(),
                                                                0.001))
            except TimeoutError:
                raise _BodyTimeout from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise _BodyTooLarge
                body_done = not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except (_BodyTooLarge, _BodyTimeout) as exc:
            if started:  # cannot happen for our handlers (they read the body first)
                raise
            if isinstance(exc, _BodyTooLarge):
                await send_json_error(send, 413, self._too_large(max_bytes), path)
            else:
                await send_json_error(send, 408, "The request body took too long to arrive.",
                                      path)

    def _too_large(self, limit: int) -> str:
        flag = "--max-request-body-bytes" if limit == self.max_body_bytes \
            else "--max-batch-file-bytes"
        return f"The request body is larger than the limit of {limit} bytes ({flag})."


# Bodies larger than this are parsed on a worker thread (a 2 MiB JSON body takes tens of
# milliseconds to parse, which every other request on the event loop would wait out).
OFF_LOOP_BODY_BYTES = 256 * 1024


async def read_body(request) -> dict:
    """The request's body as a JSON object (raises BodyError). A client that leaves while
    its body is still arriving raises starlette's ClientDisconnect (an ordinary event the
    app logs quietly)."""
    raw = await request.body()
    return await off_loop_if(len(raw) > OFF_LOOP_BODY_BYTES, parse_json_object, raw)
