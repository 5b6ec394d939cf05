"""Pieces every streaming API shares: JSON lines no client splits, merging the streams of
several prompts, and cancelling work when the HTTP client goes away. (The text deltas they
send come from the engine: `OutputKind.DELTA`, which holds back what may become a stop
string.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from fastapi import Request

T = TypeVar("T")


# Characters str.splitlines() (and so httpx's iter_lines and many other clients) treats as
# line ends, though SSE and JSON lines end only at CR / LF. JSON may escape them; we do.
_LINE_BREAKERS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029",
                                "\x85": "\\u0085"})


_encode = msgspec.json.Encoder().encode
# their UTF-8 starts (U+2028 / U+2029, U+0085): a line holding neither needs no escape (a
# false hit, as in U+2019, only costs the translate)
_BREAKER_STARTS = (b"\xe2\x80", b"\xc2\x85")


def json_line(obj) -> str:
    """One JSON document that no client can split: raw UTF-8 (as vLLM sends) except the
    line-breaking characters above. msgspec writes it (a stream's chunk in 0.4 us, where
    json.dumps and the escape took 8.5); a non-finite float becomes null, as pydantic writes
    it for vLLM (json.dumps' `-Infinity` is not JSON)."""
    data = _encode(obj)
    text = data.decode()
    start, other = _BREAKER_STARTS
    return text.translate(_LINE_BREAKERS) if start in data or other in data else text


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: yields (stream index, item).
    Leaving early closes every stream (which aborts their engine requests)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work` (a non-streaming response being built) but cancel it as soon as the client
    disconnects, so its engine requests are aborted and their KV blocks freed. Returns None
    when cancelled. Streaming responses need no help: Starlette cancels them itself."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def whole_answer(request: Request, work: Awaitable[Any], error) -> Any:
    """A non-streamed answer: `work`'s result (a Response, or a JSON body), cancelled if the
    client leaves (499); the engine refusing the request is `error(message, 400)`, the
    engine gone `error(message, 503)` (`error`: the route's own error response)."""
    from fastapi.responses import JSONResponse, Response

    from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
    from tokenmill.entrypoints.http.openai_errors import with_retry_after

    try:
        answer = await unless_disconnected(request, work)
    except EngineRequestError as exc:  # (400; 429 for load)
        return with_retry_after(error(str(exc), exc.status), exc)
    except EngineDeadError as exc:
        return error(str(exc), 503)
    if answer is None:
        return Response(status_code=499)
    return answer if isinstance(answer, Response) else JSONResponse(answer)
