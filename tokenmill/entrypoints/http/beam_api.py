"""Beam search behind the APIs: the OpenAI `use_beam_search` extension (vLLM's: `n` beams,
`length_penalty`, `early_stopping`) and TensorRT-LLM's `beam_width` (Triton generate and the
gRPC `ensemble`, with `cum_log_probs` per beam). The search itself is `beam_search.py`.

Beam search scores the model's own log-probabilities, so the sampling knobs that reshape
them (temperature, top_k / top_p / min_p) do not apply; the knobs that would change which
tokens may follow (stop sequences, bad words, penalties, logit_bias, min_tokens, a
structured-output constraint) are refused with beam search rather than ignored."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from tokenmill.beam_search import BeamSearchParams, BeamSequence, run_async
from tokenmill.sampling_params import InvalidParameter

# OpenAI fields beam search does not honour: (field, value meaning "not set")
_NOT_WITH_BEAMS = (("stop", None), ("stop_token_ids", None), ("bad_words", None),
                   ("logit_bias", None), ("min_tokens", 0), ("frequency_penalty", 0.0),
                   ("presence_penalty", 0.0), ("repetition_penalty", None), ("echo", False))


def openai_beam_params(req, max_tokens: int) -> BeamSearchParams | None:
    """The request's beam search (None without `use_beam_search`); errors name the field."""
    if not req.use_beam_search:
        for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(req, name) != default:
                raise InvalidParameter(name, f"{name} applies to beam search only: set "
                                       "use_beam_search.")
        return None
    for name, unset in _NOT_WITH_BEAMS:
        value = getattr(req, name, unset)
        if value not in (unset, [], {}) and not (name == "repetition_penalty" and value == 1):
            raise InvalidParameter(name, f"{name} is not supported with use_beam_search.")
    logprobs = getattr(req, "logprobs", None)
    if logprobs not in (None, False):
        raise InvalidParameter("logprobs", "logprobs are not supported with use_beam_search.")
    if req.structured()[0] is not None:
        raise InvalidParameter(req.structured()[1], "A structured-output constraint is not "
                               "supported with use_beam_search.")
    return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens,
                            length_penalty=req.length_penalty,
                            early_stopping=req.early_stopping)


async def search_all(state, prompts: list[list[int]], params: BeamSearchParams,
                     request_id: str, reservation=None, lora_request=None
                     ) -> list[list[BeamSequence]]:
    return list(await asyncio.gather(*(
        run_async(state.engine, ids, params, f"{request_id}-{i}", reservation, lora_request)
        for i, ids in enumerate(prompts))))


def openai_beam_body(chat: bool, req, prompts: list[list[int]],
                     beams: list[list[BeamSequence]], output, model: str) -> dict:
    """The whole response: prompt i's beams are choices i*n .. i*n+n-1, best first."""
    choices, generated = [], 0
    for i, (ids, found) in enumerate(zip(prompts, beams)):
        for k, seq in enumerate(found):
            generated += len(seq.tokens) - len(ids)
            choice = {"index": i * req.n + k, "finish_reason": seq.finish_reason,
                      "stop_reason": None, "logprobs": None}
            if chat:
                choice["message"], has_calls = output.message(seq.text)
                choice["finish_reason"] = output.finish_reason(seq.finish_reason, has_calls)
            else:
                choice["text"] = seq.text
            choices.append(choice)
    prompt_tokens = sum(len(ids) for ids in prompts)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                      "total_tokens": prompt_tokens + generated}}


def openai_beam_events(body: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """A finished beam search as a stream: each choice whole in one chunk, then usage."""
    from tokenmill.entrypoints.http.streaming import json_line

    async def events():
        head = {k: body[k] for k in ("id", "created", "model")}
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        for choice in body["choices"]:
            chunk = dict(choice)
            if chat:
                message = chunk.pop("message")
                chunk["delta"] = {k: v for k, v in message.items() if v is not None}
                if "tool_calls" in chunk["delta"]:
                    chunk["delta"]["tool_calls"] = [
                        {"index": j, **call} for j, call in enumerate(message["tool_calls"])]
            yield f"data: {json_line({**head, 'choices': [chunk]})}\n\n"
        if include_usage:
            yield f"data: {json_line({**head, 'choices': [], 'usage': body['usage']})}\n\n"
        yield "data: [DONE]\n\n"

    return events()


async def searched(request, search, reservation, error) -> tuple:
    """(the search's result, None), or (None, the response to send instead): `error(message,
    status)` for a request the engine refused (400) or a dead engine (503), 499 when the
    client left first. The reservation ends either way."""
    from fastapi.responses import Response

    from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
    from tokenmill.entrypoints.http.streaming import unless_disconnected

    try:
        found = await unless_disconnected(request, search)
    except EngineRequestError as exc:
        return None, error(str(exc), exc.status)
    except EngineDeadError as exc:
        return None, error(str(exc), 503)
    finally:
        reservation.cancel()
    return (found, None) if found is not None else (None, Response(status_code=499))


async def beam_response(state, chat: bool, req, jobs: list, beams: BeamSearchParams,
                        reservation, request, error_response, output=None):
    """The OpenAI response to a `use_beam_search` request (`jobs`: the prompts;
    `error_response`: the OpenAI error shape, openai_api.py's)."""
    from fastapi.responses import JSONResponse, StreamingResponse

    prompts = [job.ids for job in jobs]
    found, failed = await searched(request, search_all(
        state, prompts, beams, f"beam-{uuid.uuid4().hex}", reservation,
        state.lora_for(req.model)), reservation,
        error_response)
    if failed is not None:
        return failed
    body = openai_beam_body(chat, req, prompts, found, output,
                            req.model or state.served_model_name)
    if not req.stream:
        return JSONResponse(body)
    usage = req.stream_options is not None and req.stream_options.include_usage
    return StreamingResponse(openai_beam_events(body, chat, usage),
                             media_type="text/event-stream")
