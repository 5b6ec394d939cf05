"""OpenAI requests checked, tokenized and admitted before the engine runs them: the body
parsed strictly (unsupported fields refused by name, the model, logprobs and token ids
checked, admission reserved before any templating), prompts rendered or encoded, each
prompt's token budget; `prepare_completion` and `prepare_chat` (the latter shared with the
Anthropic Messages API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tokenmill.core.limits import context_overflow, token_out_of_range
from tokenmill.entrypoints.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    refuse_unsupported,
)
from tokenmill.entrypoints.api.state import Reservation, ServerState
from tokenmill.entrypoints.http.beam_api import openai_beam_params
from tokenmill.entrypoints.http.chat_output import ChatOutput
from tokenmill.entrypoints.http.openai_errors import ApiError, validation_error
from tokenmill.entrypoints.parsers.reasoning import constraint_start
from tokenmill.sampling_params import SamplingParams


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
    if req.kv_transfer_params and state.config.engine.kv_transfer_config is None:
        raise ApiError("kv_transfer_params need a server started with --kv-transfer-config.",
                       400, "kv_transfer_params")
    for name, ids in (("logit_bias", map(int, req.logit_bias or ())),
                      ("allowed_token_ids", req.allowed_token_ids or ())):
        refused = token_out_of_range(ids, state.engine.client.info.vocab_size)
        if refused is not None:
            raise ApiError(refused.message(f"{name} token ids"), 400, name)
    reservation = state.try_admit(req.slots(), req.priority or 0)  # before any tokenizing
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
class Job:
    """One engine request behind an OpenAI response: a prompt and its `n` choices."""

    ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # for echo
    mm_inputs: list = field(default_factory=list)  # its images (an image-text model)


async def prepare_completion(body: dict, state: ServerState, check_model: bool):
    """(request, jobs, beams, reservation); ApiError / ValueError: refused (any reservation
    released)."""
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
            jobs.append(Job(ids, req.sampling_params(max_tokens, req.logprobs,
                                                      state.settings.sampling_defaults), text))
        await state.check_structured(*req.structured())
        beams = openai_beam_params(req, min(job.params.max_tokens for job in jobs))
    except (ApiError, ValueError):  # ours, or SamplingParams validation
        if reservation is not None:
            reservation.cancel()
        raise
    return req, jobs, beams, reservation


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
    mm_inputs: list = field(default_factory=list)  # its images (an image-text model)


async def prepare_chat(body: dict, state: ServerState, check_model: bool = True) -> ChatRun:
    """ApiError / ValueError: refused (any reservation released)."""
    reservation = None
    try:
        req, reservation = _parse(ChatCompletionRequest, body, state, check_model)
        req.check_template(state.config.trust_request_chat_template)
        plan = req.plan_tools(state.tool_parser is not None)
        tools = {"tools": plan.tools} if plan is not None else {}
        urls = [] if state.images is not None else None
        ids = await state.prompts.render(req.plain_messages(urls), "messages",
                                         add_generation_prompt=req.add_generation_prompt,
                                         chat_template=req.chat_template,
                                         **(req.chat_template_kwargs or {}), **tools)
        ids, mm_inputs = await state.images.prepare(ids, urls) if urls else (ids, [])
        _check_ids(ids, state, "messages")
        max_tokens = _max_tokens(req.requested_max_tokens(), len(ids), state,
                                 state.config.max_dec_len, "messages")
        top = req.top_logprobs or 0
        params = req.sampling_params(max_tokens, top if req.logprobs else None,
                                     state.settings.sampling_defaults)
        await state.check_structured(*req.structured())
        if state.reasoning is not None and params.structured_outputs is not None:
            # the constraint applies to the answer, after the reasoning section
            params.structured_outputs.after_token_ids = constraint_start(
                state.tokenizer, ids, state.reasoning.format)
        beams = openai_beam_params(req, max_tokens)
        if beams is not None and mm_inputs:
            raise ApiError("Beam search does not take images.", 400, "use_beam_search")
    except (ApiError, ValueError):
        if reservation is not None:
            reservation.cancel()
        raise
    if plan is not None and plan.mode == "auto" and state.tool_parser.special_markers:
        params.skip_special_tokens = False  # (the parser reads its control-token markers)
    if state.reasoning is not None and state.reasoning.harmony:
        params.skip_special_tokens = False  # (gpt-oss' channels are control tokens)
    output = ChatOutput(state.reasoning, plan, state.tool_parser, state.config.api.response_role)
    return ChatRun(req, ids, params, output, reservation, beams, mm_inputs)
