"""The seed's native API: `text`/`input_ids`/`messages` in, JSON lines (or one JSON) out
(requests are validated and built by `native_protocol.py`).

Field names, defaults and error texts follow the seed (spec §1.4.1-1.4.4), with its bugs
fixed: tokens stream one message per step (not buffered to the end), `error_msg` is a plain
sentence (not a stringified list), and errors carry a fitting HTTP status and `error_code`."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_engine import (
    DuplicateRequestError,
    EngineDeadError,
    EngineRequestError,
)
from tokenmill.entrypoints.http.native_protocol import (
    NativeError,
    NativeRequest,
    build_request,
    echoed_request_id,
)
from tokenmill.entrypoints.http.openai_api import RETRY_AFTER_S
from tokenmill.entrypoints.http.state import ServerState
from tokenmill.entrypoints.http.streaming import json_line, unless_disconnected
from tokenmill.outputs import CompletionOutput, OutputKind


def _now() -> str:
    return datetime.datetime.now().isoformat(sep=" ", timespec="microseconds")


def _ends_with_stop_token(c: CompletionOutput) -> bool:
    """Whether the EOS / stop token that ended the sequence is its last id (not shown: seed
    behaviour)."""
    return c.finish_reason == "stop" and (c.stop_reason is None
                                          or isinstance(c.stop_reason, int))


def error_body(req_id: str | None, message: str, status: int) -> dict:
    return {"req_id": req_id, "error_msg": message, "error_code": status}


def error_response(body: dict, message: str, status: int,
                   headers: dict | None = None) -> JSONResponse:
    """A refused request in the seed's shape; its `req_id` is echoed when it is a valid one,
    and a 503 says when to retry."""
    req_id = echoed_request_id(body)
    if status == 503:
        headers = {**(headers or {}), "Retry-After": RETRY_AFTER_S}
    return JSONResponse({**error_body(req_id, message, status), "result": ""},
                        status_code=status, headers=headers)


async def _messages(req: NativeRequest, state: ServerState,
                    received: str) -> AsyncIterator[dict]:
    """One message per engine step (several steps' when the reader fell behind): the new
    text and ids since the previous message."""
    started = time.monotonic()
    stream = state.engine.generate(req.prompt_token_ids, req.params, request_id=req.req_id,
                                   reservation=req.reservation, output_kind=OutputKind.DELTA)
    texts: list[str] = []  # everything so far, for the last message
    ids: list[int] = []
    generated = 0
    async with contextlib.aclosing(stream):
        while True:
            try:
                # asyncio.timeout, not wait_for: wait_for runs anext in a task of its own and,
                # when a token arrives as the request is cancelled, returns the token and drops
                # the cancellation, so a cancelled request ran on to max_dec_len.
                async with asyncio.timeout(req.timeout):
                    out = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield error_body(req.req_id, f"Timed out: no new token within {req.timeout:g} "
                                 "seconds.", 504)
                return
            c = out.outputs[0]
            first, text = len(ids), c.text
            ids += c.token_ids
            texts.append(text)
            generated += len(c.token_ids)
            if out.finished and c.token_ids and _ends_with_stop_token(c):
                ids.pop()
            new_ids = ids[first:]

            def message(text: str, new_ids: list[int], send_idx: int, end: bool) -> dict:
                m = {"req_id": req.req_id, "token": text, "token_ids": new_ids,
                     "is_end": int(end), "send_idx": send_idx, "error_msg": "",
                     "error_code": 0}
                if req.benchmark:
                    m.update(http_received_time=received, inference_current_step_time=_now(),
                             inference_time_cost=round(time.monotonic() - started, 6))
                return m

            if not out.finished:
                yield message(text, new_ids, first, False)
                continue
            # The seed's ending: the last tokens on a line of their own, then a line with no
            # token whose send_idx is the total, so send_idx always counts what came before.
            if text or new_ids:
                yield message(text, new_ids, first, False)
            final = message("", [], len(ids), True)
            final.update(tokens_all="".join(texts), tokens_all_ids=ids,
                         tokens_all_num=len(ids), finish_reason=c.finish_reason)
            if req.return_usage:
                final["usage"] = {"prompt_tokens": len(req.prompt_token_ids),
                                  "completion_tokens": generated,
                                  "total_tokens": len(req.prompt_token_ids) + generated}
            yield final


async def admit(body: dict, state: ServerState) -> NativeRequest:
    """The seed's admission order: shutting down / queue full first (before tokenizing),
    then validation, then the duplicate check. Raises NativeError."""
    if state.draining:
        state.reject("not_ready")
        raise NativeError("The server is shutting down.", 503)
    reservation = state.try_admit(1)
    if reservation is None:
        raise NativeError(f"cached task num ({state.num_waiting()}) exceeds the "
                          f"limit ({state.max_waiting})", 503)
    try:
        req = await build_request(body, state)
        if state.engine.has_request(req.req_id):
            raise NativeError(f"The req_id {req.req_id} already exists in the current batch, "
                              "the current request will be ignored.", 409)
    except BaseException:
        reservation.cancel()
        raise
    req.reservation = reservation
    return req


def stream_messages(req: NativeRequest, state: ServerState,
                    received: str | None = None) -> AsyncIterator[dict]:
    """The per-step messages of an admitted request; failures end it with an error message."""
    return _guard(_messages(req, state, received or _now()))


async def handle(body: dict, request: Request, state: ServerState) -> Response:
    received = _now()
    try:
        req = await admit(body, state)
    except NativeError as exc:
        return error_response(body, exc.message, exc.status)
    messages = _messages(req, state, received)
    if req.stream and not state.disable_streaming and not req.return_all_tokens:
        return StreamingResponse(_json_lines(messages), media_type="text/event-stream")
    response = await unless_disconnected(
        request, _single_response(req, messages, req.stream))
    return response if response is not None else Response(status_code=499)


async def _json_lines(messages: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for message in _guard(messages):
        yield (json_line(message) + "\n").encode()


async def _guard(messages: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Engine failures become one error message; the stream ends after it."""
    try:
        async for message in messages:
            yield message
            if message["error_code"]:
                return
    except DuplicateRequestError as exc:
        yield error_body(None, str(exc), 409)
    except EngineRequestError as exc:
        yield error_body(None, str(exc), 400)
    except EngineDeadError as exc:
        yield error_body(None, str(exc), 503)


async def _single_response(req: NativeRequest, messages: AsyncIterator[dict],
                           as_stream_line: bool) -> Response:
    last: dict = {}
    async for message in _guard(messages):
        last = message
    if last.get("error_code"):
        last["req_id"] = req.req_id
        return JSONResponse({**last, "result": ""}, status_code=last["error_code"])
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
