"""A chat choice's text -> the assistant message (whole) or its deltas (streamed): the
reasoning section split off (`--reasoning-parser`), then tool calls read from the rest
(`parsers/`), in OpenAI's shapes. Streamed `tool_calls` deltas are what the OpenAI SDK's
stream helpers accumulate: each call's first delta carries its index, id, type and name,
later ones append to its `arguments`."""

from __future__ import annotations

import json
import uuid
from typing import Any

from tokenmill.entrypoints.parsers.reasoning import ReasoningParser
from tokenmill.entrypoints.parsers.tool_calls import ToolCall, ToolParser, call_from_object
from tokenmill.entrypoints.parsers.tool_request import ToolPlan
from tokenmill.entrypoints.parsers.tool_stream import ToolCallStream


def call_id(parser: ToolParser | None) -> str:
    # Mistral's templates check that ids are 9 letters and digits
    return uuid.uuid4().hex[:9] if parser is not None and parser.markers == ("[TOOL_CALLS]",) \
        else f"call_{uuid.uuid4().hex[:24]}"


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a `required` output (a JSON list, enforced by grammar; cut short by
    max_tokens it is not whole, and is returned as content)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    calls = [call_from_object(x) for x in items] if isinstance(items, list) else []
    return calls if calls and all(calls) else []


class ChatOutput:
    """How one request's choices become messages: built once per request."""

    def __init__(self, reasoning: ReasoningParser | None, plan: ToolPlan | None,
                 parser: ToolParser | None, role: str = "assistant") -> None:
        """`role`: the messages' role (--response-role)."""
        self.reasoning, self.role = reasoning, role
        self.plan = plan if plan is not None and plan.mode != "none" else None
        self.parser = (parser.for_request(self.plan.tools)
                       if parser is not None and self.plan is not None else parser)

    def _calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        mode = self.plan.mode
        if mode == "named":
            return None, [ToolCall(self.plan.name, text)]
        if mode == "required":
            calls = _required_calls(text)
            return (None, calls) if calls else (text, [])
        content, calls = self.parser.parse(text)
        return content, calls if self.plan.parallel else calls[:1]

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        named = self.plan is not None and self.plan.mode == "named"
        return "tool_calls" if has_calls and reason == "stop" and not named else reason

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message, whether it has tool calls)."""
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            message.update(content=text or None, reasoning_content=reasoning or None)
        if self.plan is None:
            return message, False
        content, calls = self._calls(text)
        message["content"] = content
        if calls:
            message["tool_calls"] = [{"id": c.id or call_id(self.parser), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in calls]
        return message, bool(calls)

    def stream(self) -> ChatDeltas:
        return ChatDeltas(self)


class ChatDeltas:
    """One streamed choice: text deltas -> delta dicts (None: nothing to send yet)."""

    def __init__(self, out: ChatOutput) -> None:
        self.out = out
        self.thinking = out.reasoning.stream() if out.reasoning is not None else None
        plan = out.plan
        self.tools = ToolCallStream(out.parser) if plan and plan.mode == "auto" else None
        self.required = ""  # (required: the JSON list, read when it ends)
        self.calls = 0
        self.named_id: str | None = None

    def _tool_deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        if not self.out.plan.parallel:
            calls = calls[:max(0, 1 - self.calls)]
        deltas = [{"index": self.calls + k, "id": c.id or call_id(self.out.parser),
                   "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}}
                  for k, c in enumerate(calls)]
        self.calls += len(deltas)
        return deltas

    def feed(self, text: str, done: bool) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text, done)
            if reasoning:
                delta["reasoning_content"] = reasoning
        plan, calls = self.out.plan, []
        if plan is None:
            pass
        elif plan.mode == "named":
            if text:
                first = self.named_id is None
                self.named_id = self.named_id or call_id(self.out.parser)
                call = {"index": 0, "function": {"arguments": text}}
                if first:
                    call = {"index": 0, "id": self.named_id, "type": "function",
                            "function": {"name": plan.name, "arguments": text}}
                    self.calls = 1
                delta["tool_calls"] = [call]
            text = ""
        elif plan.mode == "required":
            self.required += text
            text = ""
            if done:
                calls = _required_calls(self.required)
                text = "" if calls else self.required
        else:
            text, calls = self.tools.feed(text, done)
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = self._tool_deltas(calls)
        return delta or None

    def has_calls(self) -> bool:
        return self.calls > 0
