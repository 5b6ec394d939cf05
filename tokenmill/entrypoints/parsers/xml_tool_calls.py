"""Tool-call formats whose arguments are tagged text, one value per tag, typed by the
request's tool schema (a value the schema calls a string stays text; others are read as
JSON, then as a Python literal (never evaluated), else kept as text):

- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>` `<function=NAME>` then per argument
  `<parameter=KEY>` VALUE `</parameter>`, `</function>` `</tool_call>` (one newline around
  a value is the format's, not the value's).
- `glm45` (GLM-4.5 / 4.6 / 4.7): `<tool_call>NAME` then per argument `<arg_key>KEY</arg_key>`
  `<arg_value>VALUE</arg_value>`, `</tool_call>`."""

from __future__ import annotations

import ast
import json
import math
import re
from abc import abstractmethod
from typing import Any

from tokenmill.entrypoints.parsers.tool_calls import ToolCall, ToolParser

_STRINGS = {"string", "str", "text", "varchar", "char", "enum"}


def _schema_type(schema: Any) -> tuple[str | None, bool]:
    """(the argument's type, whether null is allowed); (None, False) without a schema."""
    if not isinstance(schema, dict):
        return None, False
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        kinds = [o.get("type") for o in schema["anyOf"] if isinstance(o, dict)]
    elif "enum" in schema:
        kinds = ["enum"]
    else:
        return None, False
    kinds = [str(k).strip().lower() for k in kinds if k is not None]
    nullable = "null" in kinds
    named = [k for k in kinds if k != "null"]
    return (named[0] if named else "null"), nullable


def _literal(text: str) -> tuple[bool, Any]:
    """(read, value): JSON first, then a Python literal (constants only; nothing runs)."""
    try:
        return True, json.loads(text)
    except ValueError:
        pass
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return False, None


def typed_value(raw: str, schema: Any) -> Any:
    """An argument's text as the value its schema asks for."""
    kind, nullable = _schema_type(schema)
    if kind is None:  # (no schema for it: as vLLM, the text)
        return raw
    if nullable and raw.strip().lower() in ("null", "none"):
        return None
    if kind in _STRINGS:
        return raw
    text = raw.strip()
    if text.lower() in ("null", "none"):
        return None
    if kind.startswith(("int", "uint", "long", "short")):
        try:
            return int(text)
        except ValueError:
            return raw
    if kind.startswith(("num", "float", "double")):
        try:
            value = float(text)
        except ValueError:
            return raw
        if not math.isfinite(value):  # (JSON has no inf or nan)
            return raw
        return int(value) if value.is_integer() else value
    if kind in ("boolean", "bool"):
        return text.lower() == "true"
    read, value = _literal(text)
    return value if read else raw


class _SchemaTyped(ToolParser):
    markers = ("<tool_call>",)
    END = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
    closed = False  # whether a call needs its `</tool_call>` (else its own end tag)

    def _properties(self, name: str) -> dict[str, Any]:
        for tool in self.tools or ():
            function = tool.get("function") or {}
            if function.get("name") == name:
                return (function.get("parameters") or {}).get("properties") or {}
        return {}

    def _call(self, name: str, pairs: list[tuple[str, str]]) -> ToolCall | None:
        if not name:
            return None
        props = self._properties(name)
        arguments = {key: typed_value(value, props.get(key)) for key, value in pairs}
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def parse_section(self, section: str) -> list[ToolCall]:
        if self.closed and not section.rstrip().endswith(self.END):
            return []  # (cut off inside a call)
        calls = []
        for body in self._block.findall(section):
            call = self._read(body)
            if call is None:
                return []
            calls.append(call)
        return calls

    def complete_calls(self, section: str) -> list[ToolCall]:
        end = section.rfind(self.END)
        return self.parse_section(section[:end + len(self.END)]) if end >= 0 else []

    @abstractmethod
    def _read(self, body: str) -> ToolCall | None:
        """One call from the text between a `<tool_call>` and its end; None: malformed."""


class Qwen3CoderParser(_SchemaTyped):
    # (a call cut off before `</function>` is not read: its arguments may be half there)
    _function = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                            re.S)

    def _read(self, body: str) -> ToolCall | None:
        found = self._function.match(body)
        if found is None:
            return None
        pairs = []
        for key, value in self._parameter.findall(found.group(2)):
            value = value.removeprefix("\n").removesuffix("\n")
            pairs.append((key.strip(), value))
        return self._call(found.group(1).strip(), pairs)


class Glm45Parser(_SchemaTyped):
    closed = True
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def _read(self, body: str) -> ToolCall | None:
        cut = [i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0]
        name = body[:min(cut)] if cut else body
        rest = body[len(name):]
        if "<" in name or "{" in name:  # (not a name: some other text in the tags)
            return None
        if self._pair.sub("", rest).strip():  # anything but argument pairs: malformed
            return None
        return self._call(name.strip(), [(k.strip(), v) for k, v in self._pair.findall(rest)])
