"""OpenAI-compatible completions, chat completions and model list (vLLM's response shapes).

Streams are Server-Sent Events ending in `data: [DONE]`, sent after the last content chunk
(the seed sent it before); `finish_reason` is always set on the last chunk of a choice."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
from tokenmill.entrypoints.api.state import Reservation, ServerState
from tokenmill.entrypoints.http.beam_api import beam_response
from tokenmill.entrypoints.http.chat_output import ChatDeltas, ChatOutput
from tokenmill.entrypoints.http.openai_errors import (
    ApiError,
    api_error,
    error_body,
    error_response,
    refusal,
)
from tokenmill.entrypoints.http.openai_logprobs import (
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    prompt_logprobs_field,
)
from tokenmill.entrypoints.http.openai_requests import (
    Job,
    prepare_chat,
    prepare_completion,
)
from tokenmill.entrypoints.http.streaming import json_line, merge, whole_answer
from tokenmill.outputs import CompletionOutput, OutputKind, RequestOutput


def list_models(state: ServerState) -> dict:
    """The base model's names, then each LoRA adapter with its base as `parent` (vLLM's
    cards; an adapter's `root` is its name: no server paths in responses)."""
    def card(name: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": state.created,
                "owned_by": "tokenmill", "root": name, "parent": parent,
                "max_model_len": state.max_model_len, "permission": []}

    bases = {name: base for name, _, base in state.config.engine.lora_modules or ()}
    return {"object": "list", "data": [card(name, None) for name in state.config.model_names]
            + [card(name, bases.get(name) or state.served_model_name)
               for name in state.adapters]}


class _Responder:
    """Builds one OpenAI response (streamed or whole) over one or more engine jobs."""

    def __init__(self, state: ServerState, chat: bool, req, jobs: list[Job],
                 reservation: Reservation, echo: bool = False, top_logprobs: int = 0,
                 output: ChatOutput | None = None) -> None:
        self.state, self.chat, self.req, self.jobs = state, chat, req, jobs
        self.output = output or ChatOutput(state.reasoning, None, None,
                                           state.config.api.response_role)
        self.reservation = reservation
        self.echo, self.top_logprobs = echo, top_logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = req.model or state.served_model_name
        self.n = req.n
        self.cached: dict[int, int] = {}  # per job: its prompt's prefix-cache hit tokens
        self.as_ids = state.config.api.tokens_as_ids  # (--return-tokens-as-token-ids)
        # completions' max_tokens 0 (echo): the one token generated is not returned
        self.zero = not chat and req.max_tokens == 0

    def _streams(self, kind: OutputKind) -> list[AsyncIterator[RequestOutput]]:
        lora = self.state.lora_for(self.req.model)
        return [self.state.engine.generate(job.ids, job.params, request_id=f"{self.id}-{i}",
                                           reservation=self.reservation, output_kind=kind,
                                           lora_request=lora, priority=self.req.priority or 0,
                                           mm_inputs=job.mm_inputs)
                for i, job in enumerate(self.jobs)]

    def _usage(self, completion_tokens: int) -> dict:
        prompt = sum(len(job.ids) for job in self.jobs)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                 "total_tokens": prompt + completion_tokens}
        if self.state.config.api.prompt_tokens_details:  # (--enable-prompt-tokens-details)
            usage["prompt_tokens_details"] = {"cached_tokens": sum(self.cached.values())}
        return usage

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    async def whole(self) -> Response:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(self._streams(OutputKind.FINAL_ONLY)):
            finals[i] = out
            self.cached[i] = out.num_cached_tokens
        choices, generated = [], 0
        for i in range(len(self.jobs)):
            outputs = finals[i].outputs
            generated += 0 if self.zero else sum(len(c.token_ids) for c in outputs)
            if len(outputs) > self.n:  # best_of: the n with the highest cumulative logprob
                outputs = sorted(outputs, key=lambda c: -c.cumulative_logprob)[:self.n]
            for k, c in enumerate(outputs):
                choice = {"index": i * self.n + k, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason, "logprobs": None}
                if self.chat:
                    choice["message"], has_calls = self.output.message(c.text)
                    choice["finish_reason"] = self.output.finish_reason(c.finish_reason,
                                                                        has_calls)
                    if c.logprobs is not None:
                        choice["logprobs"] = chat_logprobs(c, 0, len(c.token_ids),
                                                           self.top_logprobs, self.as_ids)
                else:
                    self._completion(choice, i, c, finals[i], 0, len(c.token_ids))
                choices.append(choice)
        body = self._envelope(sorted(choices, key=lambda ch: ch["index"]), chunk=False)
        if self.chat and self.req.prompt_logprobs is not None:  # (vLLM's, beside choices)
            body["prompt_logprobs"] = prompt_logprobs_field(finals[0].prompt_logprobs)
        body["usage"] = self._usage(generated)
        if finals[0].kv_transfer_params is not None:  # (a prefill instance's answer)
            body["kv_transfer_params"] = finals[0].kv_transfer_params
        return JSONResponse(body)

    async def events(self) -> AsyncIterator[str]:
        options = self.req.stream_options
        include_usage = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage_stats
        chats: dict[tuple[int, int], ChatDeltas] = {}  # (reasoning and tool calls)
        counts: dict[tuple[int, int], int] = {}  # generated tokens per (prompt, choice)
        ended: set[tuple[int, int]] = set()
        try:
            if self.chat:  # the first chunk of each choice announces the role
                for i in range(len(self.jobs)):
                    for k in range(self.n):
                        yield self._sse(self._envelope([{
                            "index": i * self.n + k, "logprobs": None, "finish_reason": None,
                            "delta": {"role": self.output.role, "content": ""}}],
                            chunk=True))
            async for i, out in merge(self._streams(OutputKind.DELTA)):
                self.cached[i] = out.num_cached_tokens
                for c in out.outputs:  # (each with what is new since the last)
                    key = (i, c.index)
                    if key in ended:
                        continue
                    done = c.finish_reason is not None
                    text, new_ids, first = c.text, c.token_ids, counts.get(key, 0)
                    counts[key] = first + len(new_ids)
                    delta = None
                    if self.chat:
                        deltas = chats.setdefault(key, self.output.stream())
                        delta = deltas.feed(text, done)
                        if delta is None and not done and (not new_ids or c.logprobs is None):
                            continue
                        if done:
                            c.finish_reason = self.output.finish_reason(c.finish_reason,
                                                                        deltas.has_calls())
                    elif not text and not new_ids and not done:
                        continue
                    if done:
                        ended.add(key)
                    chunk = self._chunk(i, c, text, first, done, delta, out)
                    if continuous:
                        chunk["usage"] = self._usage(sum(counts.values()))
                    yield self._sse(chunk)
            if include_usage:
                usage = self._envelope([], chunk=True)
                usage["usage"] = self._usage(sum(counts.values()))
                yield self._sse(usage)
        except EngineRequestError as exc:
            yield self._sse(error_body(str(exc), exc.status))
        except EngineDeadError as exc:
            yield self._sse(error_body(str(exc), 503))
        yield "data: [DONE]\n\n"

    def _completion(self, choice: dict, i: int, c: CompletionOutput, out: RequestOutput,
                    first: int, end: int) -> None:
        """A completions choice's text and logprobs (`c`'s tokens `first`..: the prompt
        echoed and scored before the first) and vLLM's prompt_logprobs."""
        job, echo = self.jobs[i], self.echo and first == 0
        prefix = job.prompt_text or "" if echo else ""
        choice["text"] = prefix + ("" if self.zero else c.text)
        if self.zero:
            end, choice["finish_reason"] = 0, "length"
        if self.req.logprobs is not None and (c.logprobs is not None or self.zero):
            logprobs = completion_logprobs(c, 0, end, len(prefix), self.as_ids)
            choice["logprobs"] = echoed_logprobs(
                job.ids, out.prompt_logprobs, self.state.tokenizer.decode(job.ids[:1]),
                logprobs, self.as_ids) if echo else logprobs
        if self.req.prompt_logprobs is not None and first == 0:
            choice["prompt_logprobs"] = prompt_logprobs_field(out.prompt_logprobs)

    def _chunk(self, i: int, c: CompletionOutput, text: str, first: int, done: bool,
               delta: dict | None = None, out: RequestOutput | None = None) -> dict:
        """`c`: a delta; `first`: the index of its first token in the whole choice."""
        end = len(c.token_ids)
        choice = {"index": i * self.n + c.index, "logprobs": None,
                  "finish_reason": c.finish_reason if done else None,
                  "stop_reason": c.stop_reason if done else None}
        if self.chat:
            choice["delta"] = delta or ({} if done else {"content": ""})
            if c.logprobs is not None:
                choice["logprobs"] = chat_logprobs(c, 0, end, self.top_logprobs, self.as_ids)
        else:
            self._completion(choice, i, c, out, first, end)
        return self._envelope([choice], chunk=True)

    @staticmethod
    def _sse(obj: dict) -> str:
        return f"data: {json_line(obj)}\n\n"

    async def respond(self, request: Request) -> Response:
        if self.req.stream:
            return StreamingResponse(self.events(), media_type="text/event-stream")
        return await whole_answer(request, self.whole(), error_response)


async def create_completion(body: dict, request: Request, state: ServerState,
                            check_model: bool = True) -> Response:
    try:
        req, jobs, beams, reservation = await prepare_completion(body, state, check_model)
    except (ApiError, ValueError) as exc:
        return api_error(exc)
    if beams is not None:
        return await beam_response(state, False, req, jobs, beams, reservation, request,
                                   error_response)
    return await _Responder(state, False, req, jobs, reservation,
                            echo=req.echo).respond(request)


async def answer(body: dict, state: ServerState, chat: bool) -> tuple[int, dict]:
    """The route's whole (non-streamed) answer as (status, JSON body): the Batch API's
    lines run through the same checks and engine calls as live requests."""
    try:
        if chat:
            run = await prepare_chat(body, state)
            req, jobs, beams, reservation = run.req, [Job(run.ids, run.params,
                                                           mm_inputs=run.mm_inputs)], run.beams, \
                run.reservation
        else:
            req, jobs, beams, reservation = await prepare_completion(body, state, True)
        if beams is not None:
            reservation.cancel()
            raise ApiError("Beam search is not run in batches.", 400, "use_beam_search")
        responder = _Responder(state, chat, req, jobs, reservation,
                               top_logprobs=getattr(req, "top_logprobs", 0) or 0,
                               echo=getattr(req, "echo", False),
                               output=run.output if chat else None)
        response = await responder.whole()
    except (ApiError, ValueError, EngineRequestError, EngineDeadError) as exc:
        return refusal(exc)
    return response.status_code, json.loads(response.body)


async def create_chat_completion(body: dict, request: Request, state: ServerState,
                                 check_model: bool = True) -> Response:
    try:
        run = await prepare_chat(body, state, check_model)
    except (ApiError, ValueError) as exc:
        return api_error(exc)
    job = Job(run.ids, run.params, mm_inputs=run.mm_inputs)
    if run.beams is not None:
        return await beam_response(state, True, run.req, [job], run.beams, run.reservation,
                                   request, error_response, run.output)
    responder = _Responder(state, True, run.req, [job], run.reservation,
                           top_logprobs=run.req.top_logprobs or 0, output=run.output)
    return await responder.respond(request)
