"""The seed's native API, transport-free: a request admitted in the seed's order and the JSON
messages it yields per step (HTTP sends them as lines or one body, gRPC as tensors)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator

from tokenmill.engine.async_engine import (
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
)
from tokenmill.entrypoints.api.native_protocol import NativeError, NativeRequest, build_request
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.outputs import CompletionOutput, OutputKind


def received_time() -> str:
    return datetime.datetime.now().isoformat(sep=" ", timespec="microseconds")


def _ends_with_stop_token(c: CompletionOutput) -> bool:
    """Whether the EOS / stop token that ended the sequence is its last id (not shown: seed
    behaviour)."""
    return c.finish_reason == "stop" and (c.stop_reason is None
                                          or isinstance(c.stop_reason, int))


def error_body(req_id: str | None, message: str, status: int) -> dict:
    return {"req_id": req_id, "error_msg": message, "error_code": status}


async def step_messages(req: NativeRequest, state: ServerState,
                    received: str) -> AsyncIterator[dict]:
    """One message per engine step (several steps' when the reader fell behind): the new
    text and ids since the previous message."""
    started = time.monotonic()
    stream = state.engine.generate(req.prompt_token_ids, req.params, request_id=req.req_id,
                                   reservation=req.reservation, output_kind=OutputKind.DELTA,
                                   lora_request=req.lora_request, priority=req.priority,
                                   mm_inputs=req.mm_inputs)
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
                    m.update(http_received_time=received,
                             inference_current_step_time=received_time(),
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
    try:
        reservation = state.try_admit(1)
    except EngineOverloadedError as exc:
        raise NativeError(str(exc), 429, exc.retry_after) from None
    except ValueError as exc:
        raise NativeError(str(exc), 400) from None
    if reservation is None:
        raise NativeError(f"cached task num ({state.num_waiting()}) exceeds the "
                          f"limit ({state.config.max_cached_task_num})", 503)
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
    return guarded(step_messages(req, state, received or received_time()))


async def guarded(messages: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Engine failures become one error message; the stream ends after it."""
    try:
        async for message in messages:
            yield message
            if message["error_code"]:
                return
    except DuplicateRequestError as exc:
        yield error_body(None, str(exc), 409)
    except EngineRequestError as exc:
        yield error_body(None, str(exc), exc.status)
    except EngineDeadError as exc:
        yield error_body(None, str(exc), 503)
