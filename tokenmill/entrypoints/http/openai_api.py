"""OpenAI-compatible completions, chat completions and model list (vLLM's response shapes).

Streams are Server-Sent Events ending in `data: [DONE]`, sent after the last content chunk
(the seed sent it before); `finish_reason` is always set on the last chunk of a choice."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from tokenmill.core.limits import context_overflow, token_out_of_range
from tokenmill.engine.async_engine import EngineDeadError, EngineRequestError
from tokenmill.entrypoints.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    refuse_unsupported,
)
from tokenmill.entrypoints.api.state import Reservation, ServerState
from tokenmill.entrypoints.http.beam_api import beam_response, openai_beam_params
from tokenmill.entrypoints.http.chat_output import ChatDeltas, ChatOutput
from tokenmill.entrypoints.http.openai_errors import (
    ApiError,
    api_error,
    error_body,
    error_response,
    validation_error,
)
from tokenmill.entrypoints.http.openai_logprobs import (
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    prompt_logprobs_field,
)
from tokenmill.entrypoints.http.streaming import json_line, merge, unless_disconnected
from tokenmill.entrypoints.parsers.reasoning import constraint_start
from tokenmill.outputs import CompletionOutput, OutputKind, RequestOutput
from tokenmill.sampling_params import SamplingParams


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


def _parse(model_cls, body: dict, state: ServerState, check_model: bool):
    try:
        refuse_unsupported(body)
        req = model_cls.model_validate(body)
        req.check()
    except ValidationError as exc:
        raise validation_error(exc) from None
    except ValueError as exc:
        raise ApiError(str(exc), 400, getattr(exc, "param", None)) from None
    if check_model and req.model is not None and req.model not in state.model_names:
        raise ApiError(f"The model `{req.model}` does not exist.", 404, "model")
    for name in ("logprobs", "top_logprobs"):  # (--max-logprobs below the schema's cap)
        asked = getattr(req, name, None)
        if type(asked) is int and asked > state.config.api.max_logprobs:
            raise ApiError(f"{name} may be at most {state.config.api.max_logprobs} on this server "
                           f"(--max-logprobs), got {asked}.", 400, name)
    problem = state.priority_problem(req.priority or 0)
    if problem is not None:
        raise ApiError(problem, 400, "priority")
    for name, ids in (("logit_bias", map(int, req.logit_bias or ())),
                      ("allowed_token_ids", req.allowed_token_ids or ())):
        refused = token_out_of_range(ids, state.engine.client.info.vocab_size)
        if refused is not None:
            raise ApiError(refused.message(f"{name} token ids"), 400, name)
    reservation = state.try_admit(req.slots())  # before any tokenizing or templating
    if reservation is None:
        raise ApiError("The server is overloaded: too many requests are waiting. Retry later.",
                       503)
    return req, reservation




def _check_ids(ids: list[int], state: ServerState, what: str) -> None:
    if not ids:
        raise ApiError("The prompt is empty.", 400, what)
    refused = token_out_of_range(ids, len(state.tokenizer))
    if refused is not None:
        raise ApiError(refused.message("Prompt token ids"), 400, what)


def _max_tokens(requested: int | None, n_in: int, state: ServerState, default: int | None,
                what: str) -> int:
    """The completion's token budget: `requested`, else `default` (capped by the room left),
    else all the room left. A prompt that leaves no room is refused for its own length."""
    limit = state.max_model_len
    room = limit - n_in
    if requested is not None and requested < 1:
        raise ApiError(f"max_tokens must be at least 1, got {requested}.", 400, "max_tokens")
    overflow = context_overflow(n_in, requested or 1, limit)
    if overflow is not None and overflow.no_room:
        raise ApiError(f"This model's maximum context length is {limit} tokens. However, your "
                       f"{what} has {n_in} tokens, which leaves no room for a completion. "
                       f"Please reduce the length of the {what}.", 400, what)
    if overflow is not None:
        raise ApiError(f"This model's maximum context length is {limit} tokens. However, you "
                       f"requested {n_in + requested} tokens ({n_in} in the {what}, "
                       f"{requested} in the completion). Please reduce the length of the "
                       f"{what} or completion.", 400, "max_tokens")
    budget = requested if requested is not None else min(default or room, room)
    # (the model's generation config caps every request, as vLLM's max_new_tokens default)
    return min(budget, state.settings.sampling_defaults.get("max_tokens", budget))


@dataclass
class _Job:
    """One engine request behind an OpenAI response: a prompt and its `n` choices."""

    ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # for echo


class _Responder:
    """Builds one OpenAI response (streamed or whole) over one or more engine jobs."""

    def __init__(self, state: ServerState, chat: bool, req, jobs: list[_Job],
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
                                           lora_request=lora, priority=self.req.priority or 0)
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
            yield self._sse(error_body(str(exc), 400))
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
        try:
            response = await unless_disconnected(request, self.whole())
        except EngineRequestError as exc:
            return error_response(str(exc), 400)
        except EngineDeadError as exc:
            return error_response(str(exc), 503)
        return response if response is not None else Response(status_code=499)


async def create_completion(body: dict, request: Request, state: ServerState,
                            check_model: bool = True) -> Response:
    reservation = None
    try:
        req, reservation = _parse(CompletionRequest, body, state, check_model)
        jobs = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                ids = await state.prompts.encode(prompt, "prompt")
                text = prompt
            else:
                ids, text = list(prompt), None
            _check_ids(ids, state, "prompt")
            if text is None and req.echo:
                text = state.tokenizer.decode(ids)
            max_tokens = _max_tokens(req.max_tokens or (1 if req.max_tokens == 0 else None),
                                     len(ids), state, None, "prompt")
            jobs.append(_Job(ids, req.sampling_params(max_tokens, req.logprobs,
                                                      state.settings.sampling_defaults), text))
        await state.check_structured(*req.structured())
        beams = openai_beam_params(req, min(job.params.max_tokens for job in jobs))
    except (ApiError, ValueError) as exc:  # ours, or SamplingParams validation
        if reservation is not None:
            reservation.cancel()
        return api_error(exc)
    if beams is not None:
        return await beam_response(state, False, req, jobs, beams, reservation, request,
                                   error_response)
    return await _Responder(state, False, req, jobs, reservation,
                            echo=req.echo).respond(request)


@dataclass
class ChatRun:
    """A chat request checked, rendered and admitted: what the engine runs and how its text
    becomes a message (shared with the Anthropic Messages API, which speaks through it)."""

    req: ChatCompletionRequest
    ids: list[int]
    params: SamplingParams
    output: ChatOutput
    reservation: Reservation
    beams: Any = None


async def prepare_chat(body: dict, state: ServerState, check_model: bool = True) -> ChatRun:
    """ApiError / ValueError: refused (any reservation released)."""
    reservation = None
    try:
        req, reservation = _parse(ChatCompletionRequest, body, state, check_model)
        req.check_template(state.config.trust_request_chat_template)
        plan = req.plan_tools(state.tool_parser is not None)
        tools = {"tools": plan.tools} if plan is not None else {}
        ids = await state.prompts.render(req.plain_messages(), "messages",
                                         add_generation_prompt=req.add_generation_prompt,
                                         chat_template=req.chat_template,
                                         **(req.chat_template_kwargs or {}), **tools)
        _check_ids(ids, state, "messages")
        max_tokens = _max_tokens(req.requested_max_tokens(), len(ids), state,
                                 state.config.max_dec_len, "messages")
        top = req.top_logprobs or 0
        params = req.sampling_params(max_tokens, top if req.logprobs else None,
                                     state.settings.sampling_defaults)
        await state.check_structured(*req.structured())
        if state.reasoning is not None and params.structured_outputs is not None:
            # the constraint applies to the answer, after the reasoning section
            params.structured_outputs.after_token_ids = constraint_start(state.tokenizer, ids)
        beams = openai_beam_params(req, max_tokens)
    except (ApiError, ValueError):
        if reservation is not None:
            reservation.cancel()
        raise
    if plan is not None and plan.mode == "auto" and state.tool_parser.special_markers:
        params.skip_special_tokens = False  # (the parser reads its control-token markers)
    output = ChatOutput(state.reasoning, plan, state.tool_parser, state.config.api.response_role)
    return ChatRun(req, ids, params, output, reservation, beams)


async def create_chat_completion(body: dict, request: Request, state: ServerState,
                                 check_model: bool = True) -> Response:
    try:
        run = await prepare_chat(body, state, check_model)
    except (ApiError, ValueError) as exc:
        return api_error(exc)
    job = _Job(run.ids, run.params)
    if run.beams is not None:
        return await beam_response(state, True, run.req, [job], run.beams, run.reservation,
                                   request, error_response, run.output)
    responder = _Responder(state, True, run.req, [job], run.reservation,
                           top_logprobs=run.req.top_logprobs or 0, output=run.output)
    return await responder.respond(request)
