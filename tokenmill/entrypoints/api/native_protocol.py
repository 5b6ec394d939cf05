"""The seed's native API requests: field validation with the seed's error texts, defaults,
`req_id` and `messages` checks, tokenizing (off the event loop when long) and the mapping to
SamplingParams (spec §1.4.1). The responses and streams are `native_api.py`'s."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.limits import context_overflow, token_out_of_range
from tokenmill.entrypoints.api import defaults
from tokenmill.entrypoints.api.chat_content import template_content
from tokenmill.entrypoints.api.openai_protocol import CAPS
from tokenmill.entrypoints.api.prompts import PromptTooLong
from tokenmill.entrypoints.api.state import Reservation, ServerState
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import InvalidParameter, SamplingParams
from tokenmill.structured_output.response_format import from_response_format
from tokenmill.tokenizer import ChatTemplateError

# Seed defaults applied when a field is absent (spec §1.4.1 add_default_params).
DEFAULTS = defaults.NATIVE


class NativeError(Exception):
    def __init__(self, message: str, status: int = 400,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after = retry_after  # a 429's: seconds the server expects to need


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A JSON number that is also a float (an integer past 1.8e308 is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


@dataclass
class NativeRequest:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    return_usage: bool
    return_all_tokens: bool
    benchmark: bool
    timeout: float
    reservation: Reservation | None = None  # admission's, handed to the engine
    lora_request: LoRARequest | None = None  # `lora_task_id`'s adapter; None: the base model
    priority: int = 0  # (vLLM's field: lower runs first under --scheduling-policy priority)
    mm_inputs: list = field(default_factory=list)  # its images (an image-text model's)


def _first_present(body: dict, *names: str) -> tuple[str, Any] | None:
    for name in names:
        if body.get(name) is not None:
            return name, body[name]
    return None


def validate(body: dict, state: ServerState) -> dict:
    """Type and range checks with the seed's texts; returns the body with defaults filled."""
    body = {k: v for k, v in body.items() if v is not None}
    if not any(k in body for k in ("text", "input_ids", "messages")):
        raise NativeError("The input parameters should contain either `text`, `input_ids` "
                          "or `messages`")
    if "text" in body:
        if not isinstance(body["text"], str):
            raise NativeError("The `text` in input parameters must be a string")
        if not body["text"]:
            raise NativeError("The `text` in input parameters cannot be empty")
    if "input_ids" in body and not (isinstance(body["input_ids"], list)
                                    and all(_is_int(t) for t in body["input_ids"])):
        raise NativeError("The `input_ids` in input parameters must be a list")
    if "messages" in body:
        _check_messages(body["messages"])
    if "system" in body and not isinstance(body["system"], str):
        raise NativeError("The `system` in input parameters must be a string")
    for name in ("max_dec_len", "seq_len", "max_tokens", "min_dec_len"):
        if name in body and (not _is_int(body[name]) or body[name] < 1):
            raise NativeError(f"The `{name}` must be an integer and greater than 0")
    if "topp" in body and "top_p" in body:
        raise NativeError("Only one of ('topp', 'top_p') should be set")
    if "seed" in body and "infer_seed" in body:
        raise NativeError("Only one of ('infer_seed', 'seed') should be set")
    for name in ("topp", "top_p"):
        if name in body and (not _is_number(body[name]) or not 0 <= body[name] <= 1):
            raise NativeError(f"The `{name}` must be in [0, 1]")
    if "temperature" in body and (not _is_number(body["temperature"])
                                  or body["temperature"] < 0):
        raise NativeError("The `temperature` must be >= 0")
    for name in ("penalty_score", "frequency_score", "presence_score", "timeout"):
        if name in body and not _is_number(body[name]):
            raise NativeError(f"The `{name}` must be a number")
    if "timeout" in body and body["timeout"] <= 0:
        raise NativeError("The `timeout` must be a positive number of seconds")
    for name in ("seed", "infer_seed", "lora_task_id", "priority"):
        if name in body and not _is_int(body[name]):
            raise NativeError(f"The `{name}` must be an integer")
    if "priority" in body and not -(2**63) <= body["priority"] < 2**63:
        raise NativeError("The `priority` must be a 64-bit integer")
    for name in ("stream", "return_usage", "return_all_tokens", "benchmark"):
        if name in body and not isinstance(body[name], bool):
            raise NativeError(f"The `{name}` must be a boolean")
    eos = body.get("eos_token_ids")
    if eos is not None:
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        # ASCII digits only: str.isdigit() is also true of "²", which int() refuses.
        if not all(_is_int(t) or (isinstance(t, str) and t.isascii() and t.isdigit()
                                  and len(t) <= 20) for t in eos):
            raise NativeError("The eos token id should be integer.")
        body["eos_token_ids"] = [int(t) for t in eos]
    stops = body.get("stop_sequences")
    if stops is not None:
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise NativeError("The `stop_sequences` must be a list of non-empty strings")
        body["stop_sequences"] = stops
    for name in ("stop_sequences", "eos_token_ids"):
        problem = CAPS.word_list_problem(body.get(name) or [])
        if problem is not None:
            raise NativeError(f"The `{name}` {problem}")
    body["req_id"] = request_id(body) or str(uuid.uuid4())
    return {**DEFAULTS, **body}


def request_id(body: dict) -> str | None:
    """The request's `req_id`: a string (an integer is taken as its decimal text), or None
    when absent, null or empty. Anything else is refused rather than echoed as a repr."""
    value = body.get("req_id")
    if value is None or value == "":
        return None
    if _is_int(value):
        value = str(value)
    if not isinstance(value, str):
        raise NativeError("The `req_id` must be a string")
    if len(value) > CAPS.max_request_id_chars:
        raise NativeError(f"The `req_id` may have at most {CAPS.max_request_id_chars} "
                          "characters")
    return value


def echoed_request_id(body: dict) -> str | None:
    """The `req_id` an error answer may echo: the request's own when valid, else None (an
    id that was refused is never sent back)."""
    try:
        return request_id(body)
    except NativeError:
        return None


def _check_messages(messages: Any) -> None:
    """Chat turns: a list of objects with a string `role` and a string `content`, checked
    before any templating so the error names the message and field."""
    if not isinstance(messages, list) or not messages:
        raise NativeError("The `messages` in input parameters must be a non-empty list")
    if len(messages) > CAPS.max_messages:
        raise NativeError(f"The `messages` may have at most {CAPS.max_messages} items")
    for i, item in enumerate(messages):
        if not isinstance(item, dict):
            raise NativeError(f"The item in messages must be an object with `role` and "
                              f"`content` (messages[{i}])")
        if "content" not in item:
            raise NativeError(f"The item in messages must include `content` (messages[{i}])")
        if not isinstance(item.get("role"), str):
            raise NativeError(f"`messages[{i}].role` must be a string")
        content = item.get("content")
        if isinstance(content, list):  # (OpenAI's content parts: text, image_url)
            if len(content) > CAPS.max_content_parts or not all(
                    isinstance(part, dict) for part in content):
                raise NativeError(f"`messages[{i}].content` must be a string or at most "
                                  f"{CAPS.max_content_parts} content parts")
        elif not isinstance(content, str):
            raise NativeError(f"`messages[{i}].content` must be a string")


async def tokenize(body: dict, state: ServerState) -> tuple[list[int], list]:
    """The prompt's token ids, and its images (an image-text model's `image_url` parts)."""
    if "input_ids" in body:
        return list(body["input_ids"]), []
    has_template = bool(getattr(state.tokenizer, "chat_template", None))
    system = [{"role": "system", "content": body["system"]}] if "system" in body else []
    try:
        if "messages" in body:
            if not has_template:
                raise NativeError("This model does not support chat_template.")
            urls = [] if state.images is not None else None
            turns = [{**m, "content": template_content(m["content"], urls)}
                     if isinstance(m["content"], list) else m for m in body["messages"]]
            ids = await state.prompts.render(system + turns)
            return await state.images.prepare(ids, urls) if urls else (ids, [])
        if has_template:  # the seed wraps plain text as one user turn
            return await state.prompts.render(system + [{"role": "user",
                                                         "content": body["text"]}], "text"), []
        return await state.prompts.encode(body["text"], "text"), []
    except (ChatTemplateError, PromptTooLong, InvalidParameter) as exc:
        raise NativeError(str(exc)) from None


async def build_request(body: dict, state: ServerState) -> NativeRequest:
    body = validate(body, state)
    problem = state.priority_problem(body.get("priority", 0))
    if problem is not None:
        raise NativeError(problem)
    lora = None
    if "lora_task_id" in body:  # (TensorRT-LLM's field: an adapter of --lora-modules by id)
        lora = state.lora_of_task(body["lora_task_id"])
        if lora is None:
            raise NativeError(f"The `lora_task_id` ({body['lora_task_id']}) names no adapter "
                              "served here", 404)
    ids, images = await tokenize(body, state)
    n_in = len(ids)
    if n_in == 0:
        raise NativeError("The input is empty after tokenization")
    refused = token_out_of_range(ids, len(state.tokenizer)) if "input_ids" in body else None
    if refused is not None:
        raise NativeError(refused.message("Prompt token ids"))
    # (the seed's rule: room for min_dec_len tokens and one more)
    if context_overflow(n_in, body["min_dec_len"] + 1, state.max_model_len):
        raise NativeError(f"Input text is too long, input_ids_len ({n_in}) + min_dec_len "
                          f"({body['min_dec_len']}) >= max_seq_len ({state.max_model_len})")
    if n_in > state.max_seq_len:
        raise NativeError(f"Length of input token({n_in}) exceeds the limit "
                          f"MAX_SEQ_LEN({state.max_seq_len}).")
    given = _first_present(body, "max_dec_len", "seq_len", "max_tokens")
    if given is not None and given[1] > state.config.max_dec_len:
        raise NativeError(f"The parameter max_dec_len({given[1]}) exceeds the limit "
                          f"MAX_DEC_LEN({state.config.max_dec_len}).")
    room = state.max_model_len - n_in
    max_tokens = min(given[1] if given else state.config.max_dec_len, room)
    top_p = body.get("topp", body.get("top_p"))
    seed = body.get("seed", body.get("infer_seed"))
    greedy = body["temperature"] == 0 or top_p == 0
    try:
        params = SamplingParams(
            temperature=0.0 if greedy else float(body["temperature"]),
            top_p=1.0 if greedy else float(top_p), max_tokens=max_tokens,
            min_tokens=min(body["min_dec_len"], max_tokens),
            repetition_penalty=float(body["penalty_score"]),
            frequency_penalty=float(body["frequency_score"]),
            presence_penalty=float(body["presence_score"]),
            stop=body.get("stop_sequences"), stop_token_ids=body.get("eos_token_ids"),
            seed=seed, structured_outputs=from_response_format(body.get("response_format")))
        await state.check_structured(params.structured_outputs, "response_format")
    except ValueError as exc:
        raise NativeError(str(exc)) from None
    return NativeRequest(body["req_id"], ids, params, body.get("stream", False),
                         body.get("return_usage", False), body.get("return_all_tokens", False),
                         body.get("benchmark", False), float(body["timeout"]),
                         lora_request=lora, priority=body.get("priority", 0),
                         mm_inputs=images)
