"""Triton's HTTP generate extension (TensorRT-LLM `ensemble` style) and the KServe v2 model
metadata/readiness routes a Triton client expects on the same port.

`POST /v2/models/{model}[/versions/{v}]/generate` returns one JSON object;
`.../generate_stream` sends Server-Sent Events, one `data:` object per new piece of text.
Errors are `{"error": message}` with Triton's status mapping (400 invalid, 404 unknown model,
503 unavailable); once a stream has started, an error arrives as an `{"error": ...}` event."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.beam_search import run_async
from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
from tokenmill.entrypoints.api.json_body import BodyError
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.api.triton_protocol import (
    TritonError,
    beam_fields,
    logprob_fields,
    model_known,
    parse,
    parse_fields,
    perf_fields,
)
from tokenmill.entrypoints.http.openai_errors import with_retry_after
from tokenmill.entrypoints.http.request_body import read_body
from tokenmill.entrypoints.http.streaming import json_line, unless_disconnected
from tokenmill.outputs import OutputKind


def error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_router(get_state, guard: list | None = None) -> APIRouter:
    """`guard`: dependencies of the inference routes (the API key check)."""
    router = APIRouter()

    async def generate(request: Request, model: str, streaming: bool) -> Response:
        state: ServerState = get_state(request)
        if not model_known(state, model):
            return error(f"Request for unknown model: '{model}' is not found", 404)
        if state.draining or state.engine.dead is not None:
            state.reject("not_ready")
            reservation = None
        else:
            try:
                reservation = state.try_admit(1)
            except ValueError as exc:  # (a bad header; 429: EngineOverloadedError)
                return with_retry_after(error(str(exc), getattr(exc, "status", 400)), exc)
        if reservation is None:
            return error("The server is not accepting requests now (overloaded, shutting "
                         "down, or its engine stopped).", 503)
        try:
            body = await read_body(request)
            ids, params, options = await parse_fields(parse(body), state, model)
        except (BodyError, TritonError) as exc:
            reservation.cancel()
            return error(getattr(exc, "message", str(exc)), getattr(exc, "status", 400))
        except BaseException:
            reservation.cancel()
            raise
        head = {"model_name": model, "model_version": "1"}
        if options["beams"] is not None:
            return await _beam_route(request, state, ids, options, head, streaming,
                                     reservation)
        if streaming:
            stream = state.engine.generate(ids, params, reservation=reservation,
                                           output_kind=OutputKind.DELTA,
                                           lora_request=options["lora"],
                                           priority=options["priority"],
                                           mm_inputs=options["mm_inputs"])
            return StreamingResponse(_events(stream, options, head),
                                     media_type="text/event-stream")
        stream = state.engine.generate(ids, params, reservation=reservation,
                                       output_kind=OutputKind.FINAL_ONLY,
                                       lora_request=options["lora"],
                                       priority=options["priority"],
                                       mm_inputs=options["mm_inputs"])

        async def whole() -> Response:
            last = None
            async for out in stream:
                last = out
            c = last.outputs[0]
            out = {**head, "text_output": options["echo"] + c.text}
            if options["log_probs"]:
                out.update(logprob_fields(c))
            if options["perf"]:
                out.update(perf_fields(last))
            return JSONResponse(out)

        try:
            response = await unless_disconnected(request, whole())
        except EngineRequestError as exc:
            return with_retry_after(error(str(exc), exc.status), exc)
        except EngineDeadError as exc:
            return error(str(exc), 503)
        return response if response is not None else Response(status_code=499)

    # Every model has one version; the versioned paths accept any. Their OpenAPI entry
    # declares `version` too (the handlers do not read it).
    version = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        extra = {"parameters": [version]} if "{version}" in prefix else None

        @router.post(prefix + "/generate", dependencies=guard, openapi_extra=extra)
        async def generate_route(request: Request, model: str) -> Response:
            return await generate(request, model, streaming=False)

        @router.post(prefix + "/generate_stream", dependencies=guard, openapi_extra=extra)
        async def generate_stream_route(request: Request, model: str) -> Response:
            return await generate(request, model, streaming=True)

        @router.get(prefix, openapi_extra=extra)
        async def metadata(request: Request, model: str) -> Response:
            state = get_state(request)
            if not model_known(state, model):
                return error(f"Request for unknown model: '{model}' is not found", 404)
            return JSONResponse({
                "name": model, "versions": ["1"], "platform": "tokenmill",
                "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [-1]},
                           {"name": "max_tokens", "datatype": "INT32", "shape": [-1]}],
                "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]})

        @router.get(prefix + "/ready", openapi_extra=extra)
        async def model_ready(request: Request, model: str) -> Response:
            state = get_state(request)
            ok = model_known(state, model) and not state.draining and state.engine.is_alive()
            return Response(status_code=200 if ok else 400)

    return router


async def _beam_route(request: Request, state: ServerState, ids: list[int], options: dict,
                      head: dict, streaming: bool, reservation) -> Response:
    """beam_width > 1: the search's beams in one response (streamed: in one event)."""
    from tokenmill.entrypoints.http.beam_api import searched

    beams, failed = await searched(request, run_async(
        state.engine, ids, options["beams"], f"beam-{uuid.uuid4().hex}", reservation,
        options["lora"]),
        reservation, error)
    if failed is not None:
        return failed
    out = {**head, **beam_fields(beams, options)}
    if not streaming:
        return JSONResponse(out)
    event = f"data: {json_line(out)}\n\n"

    async def one() -> AsyncIterator[str]:
        yield event

    return StreamingResponse(one(), media_type="text/event-stream")


async def _events(stream: AsyncIterator, options: dict, head: dict) -> AsyncIterator[str]:
    """`stream`: delta results."""
    try:
        async for out in stream:
            c = out.outputs[0]
            if not c.text and not out.finished:
                continue
            event = {**head, "text_output": c.text}
            if options["log_probs"]:
                event.update(logprob_fields(c))
            if options["perf"]:
                event.update(perf_fields(out))
            yield f"data: {json_line(event)}\n\n"
    except EngineRequestError as exc:
        yield f"data: {json.dumps({'error': str(exc)})}\n\n"
    except EngineDeadError as exc:
        yield f"data: {json.dumps({'error': str(exc)})}\n\n"
