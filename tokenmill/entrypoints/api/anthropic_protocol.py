"""Anthropic's Messages API (`/v1/messages`) in terms of the chat request the server already
runs: a request's system prompt, turns, `tool_use` / `tool_result` blocks, tools and
tool_choice become the OpenAI chat body (templates and tool parsers see what they see for
OpenAI clients), and an assistant message becomes Anthropic's content blocks and stop reason.
Errors carry Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`)."""

from __future__ import annotations

import json
from typing import Any

# status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "timeout_error"}
# Top-level fields a Messages request may carry: the rest (`container`, `mcp_servers`, ...)
# are refused by name. The second line's change nothing here (prompt caching is automatic,
# there is one speed and one place); temperature, top_p and top_k are older SDKs' (newer
# ones send them in extra_body).
_FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream",
           "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking",
           "output_config",
           "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id",
           "workspace_id", "diagnostics"}
# Block fields Anthropic clients set that change nothing here (prompt caching is automatic).
_IGNORED_BLOCK_FIELDS = {"cache_control", "citations"}


_BLOCK = {"type": "object", "properties": {"type": {"type": "string"},
                                          "text": {"type": "string"}},
          "required": ["type"]}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["user", "assistant"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}}}
# The request body for /openapi.json (the handler checks bodies itself, in Anthropic's shape).
OPENAPI_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["model", "max_tokens", "messages"], "properties": {
        "model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "stream": {"type": "boolean"}, "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number"}, "top_k": {"type": "integer"},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"type": "object"}, "metadata": {"type": "object"}}}}}}}


class AnthropicError(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def error_body(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def _text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise AnthropicError(f"{where} must be a string or a list of text blocks.")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            raise AnthropicError(f"{where} takes text blocks only.")
        parts.append(block["text"])
    return "".join(parts)


def _blocks(message: dict, i: int) -> list[dict]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise AnthropicError(f"messages.{i}.content must be a string or a list of blocks.")
    return content


def _image_part(source: Any, where: str) -> dict:
    """An image block's source (base64 data, or a URL) as chat's `image_url` part."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(
            source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif isinstance(source, dict) and source.get("type") == "url" and isinstance(
            source.get("url"), str):
        url = source["url"]
    else:
        raise AnthropicError(f"{where}: an image block needs a source of type base64 "
                             "(media_type, data) or url.")
    return {"type": "image_url", "image_url": {"url": url}}


def _turn(message: Any, i: int) -> list[dict]:
    """One Anthropic message -> the chat messages it stands for."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise AnthropicError(f"messages.{i}: each message needs role 'user' or 'assistant'.")
    role, texts, calls, results = message["role"], [], [], []
    for j, block in enumerate(_blocks(message, i)):
        kind, where = block.get("type"), f"messages.{i}.content.{j}"
        if kind == "image" and role == "user":
            texts.append(_image_part(block.get("source"), where))
            continue
        if kind in ("image", "document", "search_result"):
            raise AnthropicError(f"{where}: {kind} blocks are not supported here: this "
                                 "server takes text, and images in user messages.")
        extra = set(block) - {"type", "text", "id", "name", "input", "tool_use_id", "content",
                              "is_error", "thinking", "signature", "data"}
        if extra - _IGNORED_BLOCK_FIELDS:
            raise AnthropicError(f"{where}: unexpected field {sorted(extra)[0]!r}.")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise AnthropicError(f"{where}: a tool_use block needs id, name and an object "
                                     "input.")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise AnthropicError(f"{where}: a tool_result block needs tool_use_id.")
            text = _text_of(block.get("content", ""), f"{where}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # (earlier turns' thinking is not shown to the model again)
        else:
            raise AnthropicError(f"{where}: a {role} message cannot hold a block of type "
                                 f"{kind!r}.")
    turn = {"role": role, "content": "".join(texts) if all(isinstance(t, str) for t in texts)
            else [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]}
    if calls:
        turn["tool_calls"] = calls
    return results + ([turn] if texts or calls or not results else [])


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise AnthropicError("tools must be a list.")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) \
                or not isinstance(tool.get("input_schema"), dict):
            raise AnthropicError(f"tools.{i}: a tool needs a name and an input_schema "
                                 "(server tools are not supported).")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool",
                                                                  "none"):
        raise AnthropicError("tool_choice must be {'type': 'auto' | 'any' | 'tool' | "
                             "'none'}.")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise AnthropicError("tool_choice of type 'tool' needs the tool's name.")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def chat_body(body: Any, count_only: bool = False) -> dict:
    """The OpenAI chat request a Messages request asks for (AnthropicError: refused);
    `count_only`: count_tokens' body (no max_tokens)."""
    if not isinstance(body, dict):
        raise AnthropicError("The body must be a JSON object.")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise AnthropicError(f"{unknown[0]}: Extra inputs are not permitted.")
    if not isinstance(body.get("model"), str):
        raise AnthropicError("model: Field required (a string).")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicError("messages: a non-empty list is required.")
    turns = []
    if body.get("system") is not None:
        turns.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, message in enumerate(messages):
        turns += _turn(message, i)
    out: dict[str, Any] = {"model": body["model"], "messages": turns}
    if not count_only:
        tokens = body.get("max_tokens")
        if type(tokens) is not int or tokens < 1:
            raise AnthropicError("max_tokens: Field required (an integer >= 1).")
        out["max_tokens"] = tokens
        for name in ("temperature", "top_p", "top_k", "stream"):
            if body.get(name) is not None:
                out[name] = body[name]
        if body.get("stop_sequences") is not None:
            out["stop"] = body["stop_sequences"]
        user = (body.get("metadata") or {}).get("user_id") \
            if isinstance(body.get("metadata"), dict) else None
        if isinstance(user, str):
            out["user"] = user
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
            if parallel is not None:
                out["parallel_tool_calls"] = parallel
    kwargs = {}
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        kwargs["enable_thinking"] = thinking["type"] == "enabled"
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict) or set(config) - {"effort", "format"}:
            raise AnthropicError("output_config takes effort and format.")
        if isinstance(config.get("effort"), str):
            kwargs["reasoning_effort"] = config["effort"]
        fmt = config.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
                    or not isinstance(fmt.get("schema"), dict):
                raise AnthropicError("output_config.format must be {'type': 'json_schema', "
                                     "'schema': {...}}.")
            out["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt["schema"]}}
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


def stop_reason(finish_reason: str | None, matched: Any, has_calls: bool
                ) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence) of an engine finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict:
    """A call's arguments as tool_use's input object ({} where they are not one)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict) -> list[dict]:
    """An OpenAI assistant message (ChatOutput's) as Anthropic content blocks."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}",
                       "name": call["function"]["name"],
                       "input": tool_input(call["function"]["arguments"])})
    return blocks
