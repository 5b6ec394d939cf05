"""Anthropic's Messages API: `POST /v1/messages` (whole, or streamed as Anthropic's typed
events: message_start, content_block_start / _delta / _stop per text, thinking or tool_use
block, message_delta with the stop reason and usage, message_stop) and
`POST /v1/messages/count_tokens`. Requests run as the chat requests they stand for
(api/anthropic_protocol.py; openai_requests.prepare_chat); errors in Anthropic's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
from tokenmill.entrypoints.api.anthropic_protocol import (
    AnthropicError,
    chat_body,
    content_blocks,
    error_body,
    stop_reason,
)
from tokenmill.entrypoints.api.openai_protocol import ChatCompletionRequest
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.http.openai_errors import (
    RETRY_AFTER_S,
    ApiError,
    validation_error,
    with_retry_after,
)
from tokenmill.entrypoints.http.openai_requests import ChatRun, prepare_chat
from tokenmill.entrypoints.http.streaming import whole_answer
from tokenmill.outputs import OutputKind


def error_response(message: str, status: int) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


def _refusal(exc: Exception) -> JSONResponse:
    return with_retry_after(error_response(getattr(exc, "message", None) or str(exc),
                                           getattr(exc, "status", 400)), exc)


async def messages(body: object, request: Request, state: ServerState) -> Response:
    try:
        run = await prepare_chat(chat_body(body), state)
    except (ApiError, ValueError) as exc:  # (ours, the chat checks', SamplingParams')
        return _refusal(exc)
    reply = _Reply(state, run)
    if run.req.stream:
        return StreamingResponse(reply.events(), media_type="text/event-stream")
    return await whole_answer(request, reply.whole(), error_response)


async def count_tokens(body: object, state: ServerState) -> Response:
    try:
        chat = chat_body(body, count_only=True)
        req = ChatCompletionRequest.model_validate({**chat, "max_tokens": 1})
        req.check()
        if req.model not in state.model_names:
            raise AnthropicError(f"model: {req.model}", 404)
        plan = req.plan_tools(state.tool_parser is not None)
        ids = await state.prompts.render(req.plain_messages(), "messages",
                                         **({"tools": plan.tools} if plan else {}))
    except ValidationError as exc:
        return error_response(validation_error(exc).message, 400)
    except ValueError as exc:
        return _refusal(exc)
    return JSONResponse({"input_tokens": len(ids)})


class _Reply:
    """One Messages response over one engine request."""

    def __init__(self, state: ServerState, run: ChatRun) -> None:
        self.state, self.run = state, run
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = run.req.model

    def _stream(self, kind: OutputKind):
        run = self.run
        return self.state.engine.generate(run.ids, run.params, request_id=self.id,
                                          mm_inputs=run.mm_inputs,
                                          reservation=run.reservation, output_kind=kind,
                                          lora_request=self.state.lora_for(self.model),
                                          priority=run.req.priority or 0)

    def _message(self, content: list, reason: str | None, sequence: str | None,
                 output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(self.run.ids), "output_tokens": output_tokens}}

    async def whole(self) -> dict:
        final = None
        async for out in self._stream(OutputKind.FINAL_ONLY):
            final = out
        c = final.outputs[0]
        message, has_calls = self.run.output.message(c.text)
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, has_calls)
        return self._message(content_blocks(message), reason, sequence, len(c.token_ids))

    async def events(self) -> AsyncIterator[str]:
        yield _event("message_start", {"type": "message_start",
                                       "message": self._message([], None, None, 0)})
        blocks, deltas, count = _Blocks(), self.run.output.stream(), 0
        reason, sequence = "end_turn", None
        try:
            async for out in self._stream(OutputKind.DELTA):
                c = out.outputs[0]
                count += len(c.token_ids)
                done = c.finish_reason is not None
                for event in blocks.feed(deltas.feed(c.text, done) or {}):
                    yield event
                if done:
                    reason, sequence = stop_reason(c.finish_reason, c.stop_reason,
                                                   deltas.has_calls())
        except EngineRequestError as exc:
            yield _event("error", error_body(str(exc), exc.status))
            return
        except EngineDeadError as exc:
            yield _event("error", error_body(str(exc), 503))
            return
        for event in blocks.close():
            yield event
        yield _event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": count}})
        yield _event("message_stop", {"type": "message_stop"})


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Blocks:
    """Chat deltas (ChatDeltas': reasoning, content, tool call pieces) -> Anthropic's block
    events, one block open at a time, numbered from 0."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def _open(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [_event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"type": "content_block_delta",
                                              "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop",
                                              "index": self.index})]

    def feed(self, delta: dict) -> list[str]:
        events = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "",
                                                  "signature": ""})
            events.append(self._delta({"type": "thinking_delta",
                                       "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if "id" in call:
                events += self._open("tool_use", {
                    "type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}",
                    "name": function.get("name", ""), "input": {}})
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": function["arguments"]}))
        return events
