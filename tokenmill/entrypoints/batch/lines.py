"""Batch request lines, as the OpenAI Batch API and vLLM's run_batch take them: one JSON
object per line, `{"custom_id", "method": "POST", "url": "/v1/chat/completions",
"/v1/completions" (or a pooling model's "/v1/embeddings", "/v1/score", "/v1/rerank"),
"body": {...}}`. Each is answered as the live route answers the same body (openai_api's
and pooling_api's `answer`: the same checks and engine calls, never streamed) into an output
line `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error":
null}`; a line that is no such request gets `"response": null` and `"error": {"code",
"message"}`. Lines run a bounded number at a time; a line refused for a full queue (503) is
retried once others finish."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from tokenmill.entrypoints.api.json_body import BodyError, parse_json_object
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.http import openai_api, pooling_api

# each endpoint a line may name -> the route answering it
URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
        "/v1/embeddings": "embeddings", "/v1/score": "score", "/v1/rerank": "rerank"}


def served_urls(pooling: bool) -> list[str]:
    """The endpoints a batch may name: a pooling model's, or a generating model's."""
    text = ("chat", "completion")
    return [url for url, route in URLS.items() if (route in text) != pooling]


MAX_LINE_BYTES = 8 << 20  # (one request's body; a larger line is refused by itself)
MAX_CUSTOM_ID = 512


def _refused(custom_id: Any, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse(raw: bytes, number: int, urls: list[str]) -> tuple[dict | None, dict | None]:
    """(the request line, None) or (None, its error line). `number`: from 1, for messages;
    `urls`: those a line may have (a batch's endpoint, or what the model serves)."""
    where = f"line {number}"
    if len(raw) > MAX_LINE_BYTES:
        return None, _refused(None, "line_too_large", f"{where} is longer than "
                              f"{MAX_LINE_BYTES} bytes.")
    try:
        line = parse_json_object(raw)
    except BodyError as exc:
        return None, _refused(None, "invalid_json", f"{where}: {exc}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return None, _refused(None, "missing_custom_id", f"{where}: custom_id must be a "
                              f"non-empty string of at most {MAX_CUSTOM_ID} characters.")
    if line.get("method", "POST") != "POST" or line.get("url") not in urls:
        return None, _refused(custom_id, "invalid_url", f"{where}: method POST and url "
                              f"{' or '.join(urls)} are supported.")
    if not isinstance(line.get("body"), dict):
        return None, _refused(custom_id, "invalid_body", f"{where}: body must be an object.")
    return line, None


async def answer(line: dict, state: ServerState, priority: int | None = None) -> dict:
    """The output line of a request line. `priority`: given to bodies that set none (a
    server's batches run behind live requests under --scheduling-policy priority)."""
    body = {**line["body"], "stream": False}
    if priority is not None and body.get("priority") is None:
        body["priority"] = priority
    route = URLS[line["url"]]
    if route in ("chat", "completion"):
        status, answer_body = await openai_api.answer(body, state, route == "chat")
    else:
        status, answer_body = await pooling_api.answer(route, body, state)
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"],
            "response": {"status_code": status, "request_id": uuid.uuid4().hex,
                         "body": answer_body}, "error": None}


async def answer_all(raws: Iterable[bytes], state: ServerState, concurrency: int = 8,
                     priority: int | None = None, retry_s: float = 0.5,
                     endpoint: str | None = None) -> AsyncIterator[tuple[int, dict]]:
    """(line number, output line) for every line, as they finish (at most `concurrency` in
    the engine at once). A line answered 503 (queue full) is tried again after
    `retry_s`, up to 20 times; then its 503 answer stands."""
    queue: asyncio.Queue = asyncio.Queue()
    slots = asyncio.Semaphore(concurrency)

    async def run(number: int, line: dict) -> None:
        out = None
        for _ in range(20):
            async with slots:
                out = await answer(line, state, priority)
            if out["response"]["status_code"] != 503:
                break
            await asyncio.sleep(retry_s)
        await queue.put((number, out))

    tasks = []
    for number, raw in enumerate(raws, 1):
        line, refused = parse(raw, number, [endpoint] if endpoint else
                              served_urls(state.pooler is not None))
        if refused is not None:
            await queue.put((number, refused))
            continue
        tasks.append(asyncio.create_task(run(number, line)))
        while len(tasks) - sum(t.done() for t in tasks) >= 4 * concurrency:
            yield await queue.get()  # (bounded: lines are read as answers come back)
    try:
        while any(not t.done() for t in tasks) or not queue.empty():
            yield await queue.get()
    finally:
        for task in tasks:
            task.cancel()
