"""OpenAI's Responses API: `POST /v1/responses` (whole, or streamed as its typed events:
response.created / in_progress, per output item output_item.added, content_part.added,
output_text.delta / function_call_arguments.delta / reasoning_text.delta and their .done,
output_item.done, then response.completed or response.incomplete, each with its
sequence_number), `GET` and `DELETE /v1/responses/{id}` over the stored responses, and
`POST /v1/responses/{id}/cancel` (background responses only: none here). Requests run as
the chat requests they stand for (api/responses_protocol.py, openai_requests.prepare_chat)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
from tokenmill.entrypoints.api.responses_protocol import (
    ResponsesError,
    ResponseStore,
    chat_body,
    conversation_of,
    dumps,
    function_call_item,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    response_object,
)
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.http.openai_errors import ApiError, api_error, error_response
from tokenmill.entrypoints.http.openai_requests import ChatRun, prepare_chat
from tokenmill.entrypoints.http.streaming import whole_answer
from tokenmill.outputs import OutputKind

STORE = ResponseStore()  # (this API process's; see docs/serving/openai.md)


async def create(body: Any, request: Request, state: ServerState) -> Response:
    try:
        history = []
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            _, history = STORE.get(str(body["previous_response_id"]))
        run = await prepare_chat(chat_body(body, history), state)
    except ResponsesError as exc:
        return error_response(exc.message, exc.status, exc.param)
    except (ApiError, ValueError) as exc:
        return api_error(exc)
    reply = _Reply(state, run, body, history)
    if run.req.stream:
        return StreamingResponse(reply.events(), media_type="text/event-stream")
    return await whole_answer(request, reply.whole(), error_response)


class _Reply:
    """One response over one engine request."""

    def __init__(self, state: ServerState, run: ChatRun, body: dict,
                 history: list[dict]) -> None:
        self.state, self.run, self.body, self.history = state, run, body, history
        self.id = new_id("resp")
        self.created = int(time.time())

    def _stream(self, kind: OutputKind):
        run = self.run
        return self.state.engine.generate(
            run.ids, run.params, request_id=f"{self.id}-{uuid.uuid4().hex[:8]}",
            mm_inputs=run.mm_inputs,
            reservation=run.reservation, output_kind=kind,
            lora_request=self.state.lora_for(run.req.model), priority=run.req.priority or 0)

    def _final(self, items: list[dict], finish_reason: str | None, output_tokens: int,
               cached: int) -> dict:
        status = "incomplete" if finish_reason == "length" else "completed"
        usage = {"input_tokens": len(self.run.ids), "output_tokens": output_tokens,
                 "total_tokens": len(self.run.ids) + output_tokens,
                 "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        response = response_object(self.id, self.body, items, status, usage, self.created)
        if self.body.get("store", True):
            STORE.put(response, conversation_of(self.history, self.body, items))
        return response

    async def whole(self) -> dict:
        final = None
        async for out in self._stream(OutputKind.FINAL_ONLY):
            final = out
        c = final.outputs[0]
        message, _ = self.run.output.message(c.text)
        return self._final(output_items(message), c.finish_reason, len(c.token_ids),
                           final.num_cached_tokens)

    async def events(self) -> AsyncIterator[str]:
        items = _Items()
        snapshot = response_object(self.id, self.body, [], "in_progress", None, self.created)
        yield items.event("response.created", response=snapshot)
        yield items.event("response.in_progress", response=snapshot)
        deltas, count, reason, cached = self.run.output.stream(), 0, None, 0
        try:
            async for out in self._stream(OutputKind.DELTA):
                c = out.outputs[0]
                count += len(c.token_ids)
                cached = out.num_cached_tokens
                done = c.finish_reason is not None
                for event in items.feed(deltas.feed(c.text, done) or {}):
                    yield event
                if done:
                    reason = c.finish_reason
        except (EngineRequestError, EngineDeadError) as exc:
            yield items.event("error", code="server_error", message=str(exc), param=None)
            return
        for event in items.close():
            yield event
        final = self._final(items.done, reason, count, cached)
        kind = "response.incomplete" if final["status"] == "incomplete" \
            else "response.completed"
        yield items.event(kind, response=final)


class _Items:
    """Chat deltas (ChatDeltas': reasoning, content, tool call pieces) -> the Responses
    API's output item events, one item open at a time; `done` holds the finished items."""

    def __init__(self) -> None:
        self.sequence = 0
        self.done: list[dict] = []
        self.open: dict | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.done)}

    def _start(self, item: dict) -> list[str]:
        events = self.close()
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.done),
                                 item=item))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", **self._at(),
                                     content_index=0, part={"type": "output_text", "text": "",
                                                            "annotations": [], "logprobs": []}))
        return events

    def close(self) -> list[str]:
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "message":
            text = item["text"]
            events.append(self.event("response.output_text.done", **self._at(),
                                     content_index=0, text=text, logprobs=[]))
            final = message_item(text, item["id"])
            events.append(self.event("response.content_part.done", **self._at(),
                                     content_index=0, part=final["content"][0]))
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **self._at(),
                                     content_index=0, text=item["text"]))
            final = reasoning_item(item["text"], item["id"])
        else:
            events.append(self.event("response.function_call_arguments.done", **self._at(),
                                     arguments=item["arguments"], name=item["name"]))
            final = function_call_item(item["call_id"], item["name"], item["arguments"],
                                       item["id"])
        events.append(self.event("response.output_item.done", output_index=len(self.done),
                                 item=final))
        self.done.append(final)
        self.open = None
        return events

    def feed(self, delta: dict) -> list[str]:
        events = []
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                item = reasoning_item("")
                events += self._start({**item, "content": [], "status": "in_progress"})
                self.open["text"] = ""
            self.open["text"] += delta["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", **self._at(),
                                     content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                item = message_item("", status="in_progress")
                events += self._start({**item, "content": []})
                self.open["text"] = ""
            self.open["text"] += delta["content"]
            events.append(self.event("response.output_text.delta", **self._at(),
                                     content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if "id" in call:
                events += self._start(function_call_item(call["id"], function.get("name", ""),
                                                         "", status="in_progress"))
            if function.get("arguments") and self.open is not None:
                self.open["arguments"] += function["arguments"]
                events.append(self.event("response.function_call_arguments.delta",
                                         **self._at(), delta=function["arguments"]))
        return events


def add_routes(app: Any, guarded: list) -> None:
    from tokenmill.entrypoints.api.json_body import BodyError
    from tokenmill.entrypoints.http.request_body import read_body

    async def create_route(request: Request) -> Response:
        try:
            body = await read_body(request)
        except BodyError as exc:
            return error_response(str(exc), 400)
        return await create(body, request, request.app.state.server)

    async def get_route(request: Request, response_id: str) -> Response:
        try:
            return JSONResponse(STORE.get(response_id)[0])
        except ResponsesError as exc:
            return error_response(exc.message, exc.status, exc.param)

    async def delete_route(request: Request, response_id: str) -> Response:
        try:
            STORE.delete(response_id)
        except ResponsesError as exc:
            return error_response(exc.message, exc.status, exc.param)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel_route(request: Request, response_id: str) -> Response:
        try:
            STORE.get(response_id)
        except ResponsesError as exc:
            return error_response(exc.message, exc.status, exc.param)
        return error_response("Only responses created with background can be cancelled: "
                              "this one has finished.", 400, "response_id")

    for path, route, method in (("/v1/responses", create_route, "POST"),
                                ("/v1/responses/{response_id}", get_route, "GET"),
                                ("/v1/responses/{response_id}", delete_route, "DELETE"),
                                ("/v1/responses/{response_id}/cancel", cancel_route, "POST")):
        app.add_api_route(path, route, methods=[method], dependencies=guarded)
