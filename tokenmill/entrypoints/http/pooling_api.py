"""A pooling model's routes (`--runner pooling`), in OpenAI's and vLLM's shapes:
`/v1/embeddings` (floats or base64, `dimensions`), `/pooling`, `/classify`, `/score` and
`/v1/score`, `/rerank`, `/v1/rerank` and `/v2/rerank` (Cohere / Jina). Each input is one
engine request, admitted like a completion's prompts; errors in the OpenAI shape. On a
generating model these routes answer 400, and its text routes do on a pooling model."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.core.limits import token_out_of_range
from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
from tokenmill.entrypoints.api import scoring
from tokenmill.entrypoints.api.offload import off_loop_if
from tokenmill.entrypoints.api.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from tokenmill.entrypoints.api.prompts import OFF_LOOP_CHARS
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.http.openai_errors import (
    RETRY_AFTER_S,
    ApiError,
    error_response,
    parse_body,
    refusal,
)
from tokenmill.outputs import OutputKind, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

ROUTES = {"/v1/embeddings": "embeddings", "/pooling": "pooling", "/classify": "classify",
          "/score": "score", "/v1/score": "score", "/rerank": "rerank",
          "/v1/rerank": "rerank", "/v2/rerank": "rerank"}
POOL_WINDOW = 64  # a request's inputs in the engine at once
BODIES = {"embeddings": EmbeddingRequest, "pooling": PoolingRequest,
          "classify": ClassificationRequest, "score": ScoreRequest, "rerank": RerankRequest}


def _parse(model_cls, body: Any, state: ServerState):
    req = parse_body(model_cls, body, state)
    problem = state.priority_problem(req.priority)
    if problem is not None:
        raise ApiError(problem, 400, "priority")
    return req


async def _token_ids(state: ServerState, value: Any, special: bool, what: str) -> list[int]:
    """One input (a text, or token ids) -> its token ids, within the context."""
    if isinstance(value, str):
        state.prompts.check_size(len(value), what)
        ids = await off_loop_if(len(value) > OFF_LOOP_CHARS, state.tokenizer.encode, value,
                                add_special_tokens=special)
    else:
        ids = list(value)
        refused = token_out_of_range(ids, len(state.tokenizer))
        if refused is not None:
            raise ApiError(refused.message("Input token ids"), 400, what)
    if not ids:
        raise ApiError("An input is empty.", 400, what)
    if len(ids) > state.max_model_len:
        raise ApiError(f"This model's maximum context length is {state.max_model_len} "
                       f"tokens. However, an input has {len(ids)} tokens. Please reduce "
                       "its length.", 400, what)
    return ids


async def _pair_ids(state: ServerState, first: str, second: str) -> list[int]:
    state.prompts.check_size(len(first) + len(second), "text_2")
    ids = await off_loop_if(len(first) + len(second) > OFF_LOOP_CHARS,
                            scoring.pair_token_ids, state.tokenizer, first, second)
    if len(ids) > state.max_model_len:
        raise ApiError(f"This model's maximum context length is {state.max_model_len} "
                       f"tokens. However, a pair has {len(ids)} tokens. Please reduce its "
                       "length.", 400, "text_2")
    return ids


def _inputs(value: Any) -> list[Any]:
    """An `input` field as a list of inputs (a text, texts, token ids, lists of ids)."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


async def _pool(state: ServerState, req, ids: list[list[int]], params: PoolingParams,
                tag: str) -> list[RequestOutput]:
    """Each input's pooled result, in order: at most POOL_WINDOW of a request's inputs in
    the engine at once (admitted as that many sequences, all or nothing; the next input
    enters as one finishes), so a request of 2,048 texts neither fails admission nor fills
    the queue."""
    window = min(len(ids), POOL_WINDOW)
    reservation = state.try_admit(window)
    if reservation is None:
        raise ApiError("The server is overloaded: too many requests are waiting. Retry later.",
                       503)
    lora, slots = state.lora_for(req.model), asyncio.Semaphore(window)

    async def one(i: int, prompt: list[int]) -> RequestOutput:
        final = None
        async with slots:
            async for out in state.engine.generate(
                    prompt, SamplingParams(max_tokens=1), request_id=f"{tag}-{i}",
                    reservation=reservation, output_kind=OutputKind.FINAL_ONLY,
                    lora_request=lora, priority=req.priority, pooling_params=params):
                final = out
        return final

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(ids))))
    finally:
        reservation.cancel()


def _usage(results: list[RequestOutput]) -> dict:
    tokens = sum(len(r.prompt_token_ids) for r in results)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _envelope(tag: str, req, state: ServerState, data: list, results) -> dict:
    return {"id": tag, "object": "list", "created": int(time.time()),
            "model": req.model or state.served_model_name, "data": data,
            "usage": _usage(results)}


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":  # (OpenAI's: little-endian float32 bytes)
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def embeddings(req: EmbeddingRequest, state: ServerState, pooling: bool) -> dict:
    pooler = state.pooler
    task = getattr(req, "task", None) or (pooler.task if pooling and pooler else "embed")
    params = req.pooling_params() if task == "embed" else PoolingParams(task=task)
    _check_task(pooler, params)
    ids = [await _token_ids(state, x, req.add_special_tokens, "input")
           for x in _inputs(req.input)]
    tag = f"{'pool' if pooling else 'embd'}-{uuid.uuid4().hex}"
    results = await _pool(state, req, ids, params, tag)
    kind = "pooling" if pooling else "embedding"
    data = [{"index": i, "object": kind,
             ("data" if pooling else "embedding"): _encoded(r.pooled, req.encoding_format)}
            for i, r in enumerate(results)]
    return _envelope(tag, req, state, data, results)


async def classify(req: ClassificationRequest, state: ServerState) -> dict:
    params = PoolingParams(task="classify")
    _check_task(state.pooler, params)
    ids = [await _token_ids(state, x, req.add_special_tokens, "input")
           for x in _inputs(req.input)]
    tag = f"classify-{uuid.uuid4().hex}"
    results = await _pool(state, req, ids, params, tag)
    labels = state.pooler.labels
    data = [{"index": i, "label": labels[int(np.argmax(r.pooled))], "probs": r.pooled,
             "num_classes": len(r.pooled)} for i, r in enumerate(results)]
    return _envelope(tag, req, state, data, results)


async def _scores(req, state: ServerState, first: str | list[str], second: str | list[str],
                  tag: str) -> tuple[list[float], list[RequestOutput]]:
    """Each pair's score, and the engine results it took."""
    pooler = state.pooler
    try:
        scoring.check_scorer(pooler)
        pairs = scoring.pairs(first, second)
    except ValueError as exc:
        raise ApiError(str(exc), 400, getattr(exc, "param", None)) from None
    if scoring.is_cross_encoder(pooler):
        ids = [await _pair_ids(state, a, b) for a, b in pairs]
        results = await _pool(state, req, ids, PoolingParams(task="classify"), tag)
        return [r.pooled[0] for r in results], results
    texts = sorted({a for a, _ in pairs} | {b for _, b in pairs})
    ids = [await _token_ids(state, t, req.add_special_tokens, "text_2") for t in texts]
    results = await _pool(state, req, ids, PoolingParams(task="embed"), tag)
    vectors = {t: r.pooled for t, r in zip(texts, results)}
    return [scoring.cosine(vectors[a], vectors[b]) for a, b in pairs], results


async def score(req: ScoreRequest, state: ServerState) -> dict:
    tag = f"score-{uuid.uuid4().hex}"
    try:
        first, second = req.texts()
    except ValueError as exc:
        raise ApiError(str(exc), 400, "text_1") from None
    values, results = await _scores(req, state, first, second, tag)
    data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)]
    return _envelope(tag, req, state, data, results)


async def rerank(req: RerankRequest, state: ServerState) -> dict:
    tag = f"rerank-{uuid.uuid4().hex}"
    documents = req.texts()
    values, results = await _scores(req, state, req.query, documents, tag)
    order = sorted(range(len(values)), key=lambda i: -values[i])[:req.top_n]
    ranked = [{"index": i, "relevance_score": values[i],
               **({"document": {"text": documents[i]}} if req.return_documents else {})}
              for i in order]
    return {"id": tag, "model": req.model or state.served_model_name,
            "usage": {"total_tokens": _usage(results)["total_tokens"]}, "results": ranked}


def _check_task(pooler: Any, params: PoolingParams) -> None:
    if pooler is None:
        raise ApiError("This model generates text; embeddings and scores need a pooling "
                       "model (--runner pooling).", 400, "model")
    try:
        pooler.check(params)
    except ValueError as exc:
        raise ApiError(str(exc), 400, "dimensions" if "dimensions" in str(exc) else "model") \
            from None


async def answer(route: str, body: Any, state: ServerState) -> tuple[int, dict]:
    """A pooling route's answer as (status, JSON body) (the Batch API's lines use it too);
    `route`: a value of ROUTES."""
    try:
        req = _parse(BODIES[route], body, state)
        if route in ("embeddings", "pooling"):
            return 200, await embeddings(req, state, route == "pooling")
        return 200, await {"classify": classify, "score": score, "rerank": rerank}[route](
            req, state)
    except (ApiError, ValueError, EngineRequestError, EngineDeadError) as exc:
        return refusal(exc)


async def handle(route: str, body: Any, request: Request) -> Response:
    status, answer_body = await answer(route, body, request.app.state.server)
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    return JSONResponse(answer_body, status_code=status, headers=headers)


def add_routes(app: Any, guarded: list) -> None:
    """The pooling routes on the service app (behind the API key, as inference)."""
    from tokenmill.entrypoints.api.json_body import BodyError
    from tokenmill.entrypoints.api.openai_protocol import openapi_body
    from tokenmill.entrypoints.http.request_body import read_body

    def route(kind: str):
        async def call(request: Request) -> Response:
            try:
                body = await read_body(request)
            except BodyError as exc:
                return error_response(str(exc), 400)
            return await handle(kind, body, request)
        return call

    for path, kind in ROUTES.items():
        app.add_api_route(path, route(kind), methods=["POST"], dependencies=guarded,
                          openapi_extra=openapi_body(BODIES[kind]),
                          include_in_schema=path != "/v1/score" and path != "/v2/rerank")
