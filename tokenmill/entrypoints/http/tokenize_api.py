"""vLLM's `/tokenize` and `/detokenize` (also under `/v1/`): a prompt or a conversation (the
chat template applied, as a chat completion would) -> token ids; token ids -> text.
Errors in the OpenAI shape, `param` naming the field."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.core.limits import token_out_of_range
from tokenmill.entrypoints.api.offload import off_loop_if
from tokenmill.entrypoints.api.openai_protocol import (
    ChatCompletionRequest,
    check_template_kwargs,
)
from tokenmill.entrypoints.api.prompts import OFF_LOOP_CHARS
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.entrypoints.http.openai_errors import (
    ApiError,
    api_error,
    parse_body,
    validation_error,
)

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize request


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


async def tokenize(body: Any, state: ServerState) -> dict:
    chat = isinstance(body, dict) and "messages" in body
    req = parse_body(TokenizeChat if chat else TokenizeCompletion, body, state)
    tok = state.tokenizer
    if chat:
        if req.continue_final_message:
            raise ApiError("continue_final_message is not supported.", 400,
                           "continue_final_message")
        check_template_kwargs(req.chat_template_kwargs)
        try:
            messages = ChatCompletionRequest.model_validate(
                {"messages": req.messages}).plain_messages()
        except ValidationError as exc:
            raise validation_error(exc) from None
        ids = await state.prompts.render(messages, "messages",
                                         add_generation_prompt=req.add_generation_prompt,
                                         **(req.chat_template_kwargs or {}))
        if req.add_special_tokens and tok.bos_token_id is not None \
                and ids[:1] != [tok.bos_token_id]:
            ids = [tok.bos_token_id, *ids]
    else:
        state.prompts.check_size(len(req.prompt), "prompt")
        ids = await off_loop_if(len(req.prompt) > OFF_LOOP_CHARS, tok.encode, req.prompt,
                                add_special_tokens=req.add_special_tokens)
    # (a long prompt's token strings: a worker thread's job too, as its encoding is)
    strs = await off_loop_if(len(ids) > OFF_LOOP_CHARS // 4, tok.convert_ids_to_tokens,
                             ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": strs}


async def detokenize(body: Any, state: ServerState) -> dict:
    req = parse_body(Detokenize, body, state)
    refused = token_out_of_range(req.tokens, len(state.tokenizer))
    if refused is not None:
        raise ApiError(refused.message("tokens"), 400, "tokens")
    text = await off_loop_if(len(req.tokens) > OFF_LOOP_CHARS // 4, state.tokenizer.decode,
                             req.tokens)
    return {"prompt": text}


async def handle(kind: str, request: Request, body: Any):
    state: ServerState = request.app.state.server
    try:
        return await (tokenize if kind == "tokenize" else detokenize)(body, state)
    except (ApiError, ValueError) as exc:
        return api_error(exc)
