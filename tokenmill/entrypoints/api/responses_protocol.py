"""OpenAI's Responses API (`/v1/responses`) in terms of the chat request the server already
runs: `instructions`, `input` (text, or items: messages, `function_call` and
`function_call_output`), `previous_response_id` (the stored conversation before it), tools,
tool_choice and `text.format` become the OpenAI chat body; an assistant message becomes the
response's output items (`reasoning`, `message` with `output_text`, `function_call`).
`ResponseStore` keeps responses for `previous_response_id` and retrieval, bounded in count
and time."""

from __future__ import annotations

import collections
import json
import secrets
import time
from typing import Any

# Fields a Responses request may carry; the rest are refused by name. The second line's
# change nothing here.
_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
           "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "store",
           "previous_response_id", "metadata", "user", "reasoning", "truncation",
           "include", "service_tier", "safety_identifier", "prompt_cache_key", "top_logprobs"}
_REFUSED = {"background": "background responses are not supported",
            "conversation": "conversations are not supported (use previous_response_id)",
            "prompt": "stored prompts are not supported"}


class ResponsesError(ValueError):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _text_parts(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """A message's content as chat content: its text joined, or (`images`: a user message;
    an `input_image` among its parts) chat's parts, the images as `image_url` ones."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(f"{where} must be a string or a list of content parts.",
                             param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if images and kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind in ("input_text", "output_text", "text") and isinstance(part.get("text"),
                                                                            str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ResponsesError(f"{where}: content of type {kind!r} is not supported (text "
                                 "and input_image with an image_url).", param="input")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def input_messages(items: Any) -> list[dict]:
    """`input` as chat messages (consecutive function calls in one assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ResponsesError("input must be a string or a non-empty list of items.",
                             param="input")
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ResponsesError(f"{where} must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesError(f"{where}: role must be user, assistant, system or "
                                     "developer.", param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_parts(item.get("content"), where, role == "user")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ResponsesError(f"{where}: a function_call needs call_id, name and "
                                     "arguments (a JSON string).", param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ResponsesError(f"{where}: a function_call_output needs call_id.",
                                     param="input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str)
                        else _text_parts(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # (earlier turns' reasoning is not shown to the model again)
        else:
            raise ResponsesError(f"{where}: items of type {kind!r} are not supported.",
                                 param="input")
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ResponsesError("tools must be a list.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ResponsesError(f"tools[{i}]: only function tools are supported, got "
                                 f"{kind!r}.", param="tools")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {
            "type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesError("tool_choice must be auto, none, required or {'type': 'function', "
                         "'name': ...}.", param="tool_choice")


def _response_format(text: Any) -> dict | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "output", "schema": fmt["schema"],
            "strict": bool(fmt.get("strict"))}}
    raise ResponsesError("text.format must be text, json_object or json_schema (with a "
                         "schema).", param="text")


def chat_body(body: Any, history: list[dict]) -> dict:
    """The OpenAI chat request a Responses request asks for (ResponsesError: refused);
    `history`: the messages of the `previous_response_id` conversation."""
    if not isinstance(body, dict):
        raise ResponsesError("The body must be a JSON object.")
    for name, why in _REFUSED.items():
        if body.get(name):
            raise ResponsesError(f"{name}: {why}.", param=name)
    unknown = sorted(set(body) - _FIELDS - set(_REFUSED))
    if unknown:
        raise ResponsesError(f"Unknown parameter: '{unknown[0]}'.", param=unknown[0])
    if not isinstance(body.get("model"), str):
        raise ResponsesError("model is required (a string).", param="model")
    messages = list(history) + input_messages(body.get("input"))
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ResponsesError("instructions must be a string.", param="instructions")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    out: dict[str, Any] = {"model": body["model"], "messages": messages}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", "user", "parallel_tool_calls", "stream"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        out["chat_template_kwargs"] = {"reasoning_effort": reasoning["effort"]}
    return out


def output_items(message: dict) -> list[dict]:
    """An assistant message (ChatOutput's) as a response's output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        items.append(function_call_item(call["id"], call["function"]["name"],
                                        call["function"]["arguments"]))
    return items


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def function_call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
                       status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def assistant_messages(items: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a later turn continues from."""
    text = "".join(p["text"] for item in items if item["type"] == "message"
                   for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {
        "name": item["name"], "arguments": item["arguments"]}}
        for item in items if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def response_object(response_id: str, body: dict, output: list[dict], status: str,
                    usage: dict | None, created_at: int) -> dict:
    """OpenAI's response object, the request's settings echoed."""
    tools = [t for t in body.get("tools") or () if isinstance(t, dict)]
    return {"id": response_id, "object": "response", "created_at": created_at,
            "status": status, "model": body.get("model"), "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": tools, "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": body.get("reasoning"), "metadata": body.get("metadata") or {},
            "store": body.get("store", True), "truncation": body.get("truncation", "disabled"),
            "usage": usage, "user": body.get("user")}


class ResponseStore:
    """Responses kept for `GET /v1/responses/{id}` and `previous_response_id`: at most
    `capacity`, each for `ttl_s` (the oldest dropped first). One API process's."""

    def __init__(self, capacity: int = 1000, ttl_s: float = 3600.0) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        self._items: collections.OrderedDict[str, tuple[float, dict, list[dict]]] = \
            collections.OrderedDict()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items and (len(self._items) > self.capacity
                               or next(iter(self._items.values()))[0] < now - self.ttl_s):
            self._items.popitem(last=False)

    def put(self, response: dict, conversation: list[dict]) -> None:
        """`conversation`: its messages without instructions (what a later turn sees)."""
        self._items[response["id"]] = (time.monotonic(), response, conversation)
        self._expire()

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        self._expire()
        if response_id not in self._items:
            raise ResponsesError(f"Response with id '{str(response_id)[:80]}' not found.", 404,
                                 "response_id")
        _, response, conversation = self._items[response_id]
        return response, conversation

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


def conversation_of(history: list[dict], body: dict, output: list[dict]) -> list[dict]:
    """What a response's successor continues from: the history, this turn's input, its
    output (instructions are not carried over, as OpenAI's are not)."""
    return history + input_messages(body.get("input")) + assistant_messages(output)


def dumps(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)
