"""`--tool-call-parser`: each format's name and parser (tool_calls.py, xml_tool_calls.py),
and the parser a chat template's tool-call format names."""

from __future__ import annotations

from tokenmill.entrypoints.parsers.tool_calls import (
    DeepSeekV3Parser,
    GraniteParser,
    HermesParser,
    KimiK2Parser,
    Llama3JsonParser,
    MistralParser,
    OpenAIParser,
    PythonicParser,
    ToolParser,
)
from tokenmill.entrypoints.parsers.xml_tool_calls import Glm45Parser, Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
    "deepseek_v3": DeepSeekV3Parser, "pythonic": PythonicParser, "kimi_k2": KimiK2Parser,
    "granite": GraniteParser, "qwen3_coder": Qwen3CoderParser, "glm45": Glm45Parser,
    "openai": OpenAIParser}
PARSER_NAMES = tuple(PARSERS)

# What a chat template writes for a tool call, per parser: a template showing exactly one of
# these gets that parser without --tool-call-parser (pythonic calls have no marker of their
# own, so they are never guessed).
TEMPLATE_MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
                    "deepseek_v3": ("tool▁calls▁begin",),
                    "llama3_json": ("Given the following functions, please respond with a "
                                    "JSON for a function call",),
                    "kimi_k2": ("<|tool_calls_section_begin|>",),
                    "granite": ("<|tool_call|>",),
                    "qwen3_coder": ("<function=",), "glm45": ("<arg_key>",),
                    "openai": ("to=functions.",)}
# formats whose markers include hermes' `<tool_call>`: a template showing theirs is theirs
_WITHIN_HERMES = ("qwen3_coder", "glm45")


def parser_for_template(template: str | dict | None) -> str | None:
    """The parser a chat template's tool-call format names, when it names exactly one."""
    if isinstance(template, dict):  # (named templates: "default", "tool_use", ...)
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not template:
        return None
    found = [name for name, markers in TEMPLATE_MARKERS.items()
             if any(m in template for m in markers)]
    if "hermes" in found and any(name in found for name in _WITHIN_HERMES):
        found.remove("hermes")
    return found[0] if len(found) == 1 else None


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool-call parser must be one of {', '.join(PARSER_NAMES)}, got "
                         f"{name!r}.")
    return PARSERS[name]()
