"""The seed's native API: `text`/`input_ids`/`messages` in, JSON lines (or one JSON) out
(requests are validated and built by api/native_protocol.py, their messages by
api/native_messages.py).

Field names, defaults and error texts follow the seed (spec §1.4.1-1.4.4), with its bugs
fixed: tokens stream one message per step (not buffered to the end), `error_msg` is a plain
sentence (not a stringified list), and errors carry a fitting HTTP status and `error_code`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.api.native_messages import (
    admit,
    error_body,
    guarded,
    received_time,
    step_messages,
)
from tokenmill.entrypoints.api.native_protocol import NativeError, NativeRequest, echoed_request_id
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.http.openai_errors import RETRY_AFTER_S, with_retry_after
from tokenmill.entrypoints.http.streaming import json_line, unless_disconnected


def error_response(body: dict, message: str, status: int,
                   headers: dict | None = None) -> JSONResponse:
    """A refused request in the seed's shape; its `req_id` is echoed when it is a valid one,
    and a 503 says when to retry."""
    req_id = echoed_request_id(body)
    if status == 503:
        headers = {**(headers or {}), "Retry-After": RETRY_AFTER_S}
    return JSONResponse({**error_body(req_id, message, status), "result": ""},
                        status_code=status, headers=headers)


async def handle(body: dict, request: Request, state: ServerState) -> Response:
    received = received_time()
    try:
        req = await admit(body, state)
    except NativeError as exc:
        return with_retry_after(error_response(body, exc.message, exc.status), exc)
    messages = step_messages(req, state, received)
    if req.stream and not state.config.disable_streaming and not req.return_all_tokens:
        return StreamingResponse(_json_lines(messages), media_type="text/event-stream")
    response = await unless_disconnected(
        request, _single_response(req, messages, req.stream))
    return response if response is not None else Response(status_code=499)


async def _json_lines(messages: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for message in guarded(messages):
        yield (json_line(message) + "\n").encode()


async def _single_response(req: NativeRequest, messages: AsyncIterator[dict],
                           as_stream_line: bool) -> Response:
    last: dict = {}
    async for message in guarded(messages):
        last = message
    if last.get("error_code"):
        last["req_id"] = req.req_id
        retry = {"Retry-After": RETRY_AFTER_S} if last["error_code"] in (429, 503) else None
        return JSONResponse({**last, "result": ""}, status_code=last["error_code"],
                            headers=retry)
    if as_stream_line:  # DISABLE_STREAMING or return_all_tokens: one final stream message
        last.update(token=last["tokens_all"], token_ids=last["tokens_all_ids"], send_idx=0)
        return Response((json_line(last) + "\n").encode(),
                        media_type="text/event-stream")
    body = {"req_id": req.req_id, "result": last["tokens_all"],
            "tokens_all": last["tokens_all"], "error_msg": "", "error_code": 0}
    if req.return_usage:
        body["usage"] = last["usage"]
    if req.benchmark:
        body.update({k: last[k] for k in ("http_received_time", "inference_time_cost")})
    return JSONResponse(body)
