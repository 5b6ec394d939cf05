"""Pieces every streaming API shares: text deltas that never leak a stop string, merging the
streams of several prompts, and cancelling work when the HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from tokenmill.outputs import CompletionOutput

T = TypeVar("T")


# Characters str.splitlines() (and so httpx's iter_lines and many other clients) treats as
# line ends, though SSE and JSON lines end only at CR / LF. JSON may escape them; we do.
_LINE_BREAKERS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029",
                                "\x85": "\\u0085"})


def json_line(obj) -> str:
    """One JSON document that no client can split: raw UTF-8 (as vLLM sends) except the
    line-breaking characters above."""
    return json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKERS)


class DeltaTracker:
    """Turns one completion's cumulative text/ids into deltas. While running, it holds back
    the last `len(longest stop string) - 1` characters: they may still become a stop string,
    which must never reach the client (the final output has it removed)."""

    def __init__(self, stop: list[str]) -> None:
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent_text = 0
        self.sent_ids = 0

    def update(self, completion: CompletionOutput, finished: bool,
               token_ids: list[int] | None = None) -> tuple[str, list[int], int]:
        """Returns (new text, new ids, index of the first new id)."""
        ids = completion.token_ids if token_ids is None else token_ids
        text = completion.text
        end = len(text) if finished else max(self.sent_text, len(text) - self.hold)
        delta = text[self.sent_text:end]
        first = self.sent_ids
        new_ids = list(ids[first:])
        self.sent_text, self.sent_ids = end, len(ids)
        return delta, new_ids, first


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
