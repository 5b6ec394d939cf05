"""Tool-call parsers (`--tool-call-parser`; by name: tool_registry.py): a model's text ->
(content, tool calls), in the formats the models are trained on. A parser never raises on
model output: text it cannot read as tool calls is returned as content.

- `hermes` (Qwen 2.5 / 3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, any number, after optional content.
- `llama3_json` (Llama 3.1 / 3.2 JSON tools): the whole output is `{"name": ...,
  "parameters": {...}}` objects separated by `;`, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (tokenizer v3), or
  `name[ARGS]{...}` per call (v11+).
- `deepseek_v3` (DeepSeek-V3 / R1): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a ```json fence
  (V3.1: `NAME<｜tool▁sep｜>{...}`), each closed by `<｜tool▁call▁end｜>`.
- `pythonic` (Llama 3.2 / 4): `[get_weather(city="Paris"), now()]`, keyword arguments of
  Python literals, read with `ast` (never evaluated).
- `kimi_k2` (Kimi K2): `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>`
  `functions.NAME:INDEX` `<|tool_call_argument_begin|>` JSON `<|tool_call_end|>`; the
  model's own call id (`functions.NAME:INDEX`) is the call's id, as its template expects.
- `granite` (Granite 3.x): the output starts with `<|tool_call|>` (3.0) or `<tool_call>`
  (3.1+) and a JSON list of `{"name", "arguments"}`.
- `qwen3_coder` and `glm45`: arguments as tagged text, typed by the request's tool schemas
  (xml_tool_calls.py).
- `openai` (gpt-oss): harmony messages to `functions.NAME`, JSON bodies (harmony.py)."""

from __future__ import annotations

import ast
import copy
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from tokenmill.entrypoints.parsers import harmony


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments`
    id: str | None = None  # the model's own id for the call (Kimi K2); None: one is made


def _call(name, arguments) -> ToolCall | None:
    """A ToolCall from decoded JSON values, or None when they are not a name and an object
    (a string holding an object is accepted, as some models write it)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def call_from_object(obj, args_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    args = next((obj[k] for k in args_keys if k in obj), None)
    return _call(obj.get("name"), args)


def _json_values(text: str, separator: str = "") -> list | None:
    """The JSON values making up all of `text` (whitespace and `separator` between them), or
    None when anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class ToolParser(ABC):
    """Base: `markers` open a tool-call section anywhere in the text; `leading` ones only at
    its start (after whitespace)."""

    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()
    special_markers = False  # a marker is a special token of the tokenizer (see `bind`)
    tools: list[dict] | None = None  # the request's tools (`for_request`): their schemas

    def for_request(self, tools: list[dict] | None) -> ToolParser:
        """This parser for one request, knowing its tools (formats whose argument values
        are text read them by the tools' parameter schemas)."""
        bound = copy.copy(self)
        bound.tools = tools
        return bound

    def bind(self, tokenizer) -> ToolParser:
        """Notes whether the tokenizer's special tokens include a marker: then the output
        must be detokenized with them kept, or the parser never sees the marker."""
        special = set(getattr(tokenizer, "all_special_tokens", None) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special |= {t.content for t in added.values() if getattr(t, "special", False)}
        self.special_markers = any(m in special for m in self.markers + self.leading)
        return self

    def section_start(self, text: str, leading: bool = True) -> int | None:
        """Where the tool-call section starts in `text` (it may still be incomplete).
        `leading=False`: `text` is not the output's start, so only `markers` can open it."""
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        if leading:
            head = len(text) - len(text.lstrip())
            if any(text.startswith(m, head) for m in self.leading):
                found.append(head)
        return min(found) if found else None

    def hold_from(self, text: str, leading: bool = True) -> int:
        """Where text that may still become a section's start begins (len(text): none)."""
        hold = len(text)
        for m in self.markers:
            for n in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:n]):
                    hold = min(hold, len(text) - n)
                    break
        if leading:
            head = len(text) - len(text.lstrip())
            if any(m.startswith(text[head:]) for m in self.leading):
                hold = min(hold, head)  # (only whitespace so far, or a leading marker's start)
        return hold

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); no calls: the whole text is content."""
        start = self.section_start(text)
        if start is None:
            return text, []
        calls = self.parse_section(text[start:])
        if not calls:
            return text, []
        return text[:start].rstrip() or None, calls

    @abstractmethod
    def parse_section(self, section: str) -> list[ToolCall]:
        """The calls of a whole section (starting at its marker); [] if it is not one."""

    def complete_calls(self, section: str) -> list[ToolCall]:
        """The calls of an unfinished section that can no longer change (streamed before the
        output ends); by default none: a format read as a whole is sent at the end."""
        return []


class HermesParser(ToolParser):
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse_section(self, section: str) -> list[ToolCall]:
        calls = []
        for body in self._block.findall(section):
            call = call_from_object(_one_json(body))
            if call is None:
                return []
            calls.append(call)
        return calls

    def complete_calls(self, section: str) -> list[ToolCall]:
        end = section.rfind("</tool_call>")
        return self.parse_section(section[:end + len("</tool_call>")]) if end >= 0 else []


def _one_json(text: str):
    values = _json_values(text)
    return values[0] if values and len(values) == 1 else None


def _named_call(name: str, arguments_text: str) -> ToolCall | None:
    """A call whose arguments are all of `arguments_text`, which must be one JSON object."""
    arguments = _one_json(arguments_text)
    return _call(name, arguments) if isinstance(arguments, dict) else None


class Llama3JsonParser(ToolParser):
    leading = ("<|python_tag|>", "{")

    def parse_section(self, section: str) -> list[ToolCall]:
        section = section.strip().removeprefix("<|python_tag|>")
        values = _json_values(section, separator=";")
        calls = [call_from_object(v) for v in values or ()]
        return calls if calls and all(calls) else []


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)
    _named = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]")

    def parse_section(self, section: str) -> list[ToolCall]:
        calls = []
        for part in section.split("[TOOL_CALLS]")[1:]:
            named = self._named.match(part)
            if named:  # v11+: name[ARGS]{...}
                call = _named_call(named.group(1), part[named.end():])
                if call is None:
                    return []
                calls.append(call)
                continue
            value = _one_json(part)
            items = value if isinstance(value, list) else [value]
            found = [call_from_object(v) for v in items]
            if not found or not all(found):
                return []
            calls.extend(found)
        return calls


class DeepSeekV3Parser(ToolParser):
    BEGIN, CALL, SEP, CALL_END, END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                                       "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                                       "<｜tool▁calls▁end｜>")
    markers = (BEGIN,)
    _fence = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)

    def _read(self, body: str) -> ToolCall | None:
        head, sep, args = body.partition(self.SEP)
        if not sep:
            return None
        if head.strip() == "function":  # V3: function<sep>NAME\n```json ...```
            name, _, args = args.partition("\n")
        else:  # V3.1: NAME<sep>{...}
            name = head
        fenced = self._fence.match(args)
        return _named_call(name.strip(), fenced.group(1) if fenced else args)

    def parse_section(self, section: str) -> list[ToolCall]:
        body = section[len(self.BEGIN):].split(self.END)[0]
        calls = []
        for part in body.split(self.CALL)[1:]:
            call = self._read(part.split(self.CALL_END)[0])
            if call is None:
                return []
            calls.append(call)
        return calls

    def complete_calls(self, section: str) -> list[ToolCall]:
        end = section.rfind(self.CALL_END)
        return self.parse_section(section[:end]) if end >= 0 else []


class PythonicParser(ToolParser):
    leading = ("[", "<|python_start|>")

    def parse_section(self, section: str) -> list[ToolCall]:
        text = section.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return []
        if not isinstance(tree.body, ast.List):
            return []
        calls = []
        for node in tree.body.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and not node.args and all(k.arg for k in node.keywords)):
                return []
            try:  # literal_eval reads constants only: nothing in the text runs
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                arguments = json.dumps(args, ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return []
            calls.append(ToolCall(node.func.id, arguments))
        return calls


class KimiK2Parser(ToolParser):
    BEGIN, CALL, ARGS, CALL_END, END = (
        "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
        "<|tool_call_end|>", "<|tool_calls_section_end|>")
    markers = (BEGIN, "<|tool_call_section_begin|>")  # (the singular: some of its outputs)

    def parse_section(self, section: str) -> list[ToolCall]:
        body = section.split(self.END)[0].split("<|tool_call_section_end|>")[0]
        calls = []
        for part in body.split(self.CALL)[1:]:
            head, sep, args = part.split(self.CALL_END)[0].partition(self.ARGS)
            call_id = head.strip()
            name = call_id.split(":")[0].removeprefix("functions.")
            call = _named_call(name, args) if sep else None
            if call is None:
                return []
            calls.append(ToolCall(call.name, call.arguments, call_id))
        return calls

    def complete_calls(self, section: str) -> list[ToolCall]:
        end = section.rfind(self.CALL_END)
        return self.parse_section(section[:end]) if end >= 0 else []


class GraniteParser(ToolParser):
    leading = ("<|tool_call|>", "<tool_call>")

    def parse_section(self, section: str) -> list[ToolCall]:
        text = section.strip()
        for marker in self.leading:
            text = text.removeprefix(marker)
        value = _one_json(text)
        calls = [call_from_object(v) for v in value] if isinstance(value, list) else []
        return calls if calls and all(calls) else []


class OpenAIParser(ToolParser):
    """gpt-oss' harmony messages to `functions.NAME` (parsers/harmony.py), after
    `--reasoning-parser gpt_oss` took the analysis channel out."""

    markers = ("<|start|>assistant<|channel|>commentary to=", "<|channel|>commentary to=",
               "<|start|>assistant to=")

    def bind(self, tokenizer) -> ToolParser:
        super().bind(tokenizer)
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.special_markers = "<|channel|>" in vocab  # (harmony's markers are tokens)
        return self

    def parse_section(self, section: str) -> list[ToolCall]:
        content, calls = harmony.tool_calls(section)
        return [] if content is not None else [ToolCall(n, a) for n, a in calls]
