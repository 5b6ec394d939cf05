"""What a chat request asks of tools: the `tools` / `tool_choice` / `parallel_tool_calls`
fields checked (OpenAI's shapes), the grammar that enforces `required` and named choices, and
the history's assistant `tool_calls` made ready for chat templates.

- `none`: tools are rendered for the model to read, its output is returned as content.
- `auto` (the default when tools are given): the output is read by the server's
  `--tool-call-parser`; a request asking for it on a server without one gets 400.
- `required`: the output is constrained to a JSON list of `{"name", "parameters"}` objects,
  one of the given tools each (one at most when `parallel_tool_calls` is false).
- a named function: the output is constrained to that function's parameters schema and is
  returned as the call's arguments."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import InvalidParameter

MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class _ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"] = "function"
    function: _ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]]  # as the chat template takes them
    name: str | None = None  # the named function
    parallel: bool = True

    def constraint(self) -> dict[str, Any] | None:
        """The structured-output spec that enforces `required` / named, or None."""
        if self.mode == "named":
            return {"json": _parameters(self.tools, self.name)}
        if self.mode != "required":
            return None
        choices = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t["function"]["name"]]},
            "parameters": _parameters([t], t["function"]["name"])},
            "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema}


def _parameters(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"].get("parameters") or {"type": "object", "properties": {}}
    raise AssertionError(name)


def plan_tools(tools: list[ToolDefinition] | None, choice: Any, parallel: bool | None,
               has_parser: bool) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools); errors name the field."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidParameter("tool_choice", "tool_choice requires tools to be given.")
        return None
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "tools must have distinct function names.")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidParameter("tool_choice", f"tool_choice names {choice.function.name!r}, "
                                   "which is not among the tools.")
        return ToolPlan("named", rendered, choice.function.name, parallel is not False)
    mode = choice or "auto"
    if mode == "auto" and not has_parser:
        raise InvalidParameter("tool_choice", '"auto" tool choice requires the server to run '
                               "with --tool-call-parser (hermes, llama3_json, mistral, "
                               'deepseek_v3 or pythonic); "required", a named function and '
                               '"none" work without one.')
    return ToolPlan(mode, rendered, None, parallel is not False)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` whose arguments are JSON text get them as objects, which chat
    templates expect (they render them with `tojson`)."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            continue
        where = f"messages[{i}].tool_calls"
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise InvalidParameter("messages", f"{where} must be a list of tool calls.")
        fixed = []
        for j, call in enumerate(calls):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidParameter("messages", f"{where}[{j}].function must have a name.")
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = None
            if not isinstance(arguments, dict):
                raise InvalidParameter("messages", f"{where}[{j}].function.arguments must be "
                                       "a JSON object.")
            fixed.append({**call, "function": {**function, "arguments": arguments}})
        message["tool_calls"] = fixed
    return messages
