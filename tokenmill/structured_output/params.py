"""What a request asks its output to follow (vLLM's `StructuredOutputsParams`): exactly one
of `json` (a JSON schema, as text or a dict), `json_object` (any JSON object), `regex`,
`choice` (one of these strings) or `grammar` (EBNF / GBNF)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

from tokenmill.sampling_params import InvalidParameter

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65536  # a schema / regex / grammar's text, or all choices together


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # the constraint starts once the output holds these tokens (the end of a reasoning
    # section: set by the server's --reasoning-parser); not part of the grammar
    after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        asked = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(asked) != 1:
            raise InvalidParameter(
                "structured_outputs", "structured_outputs takes exactly one of json, "
                f"json_object, regex, choice or grammar; got {asked or 'none'}.")
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)
        if self.json is not None and not isinstance(self.json, str):
            raise InvalidParameter("json", "json must be a JSON schema (an object or its "
                                   "JSON text).")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameter(name, f"{name} must be a non-empty string.")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameter("choice", "choice must be a non-empty list of non-empty "
                                   "strings.")
        if self.json_object not in (None, True):
            raise InvalidParameter("json_object", "json_object must be true when given.")
        after = self.after_token_ids
        if after is not None and (not isinstance(after, list) or not after or not all(
                isinstance(t, int) and 0 <= t < 2**63 for t in after)):
            raise InvalidParameter("after_token_ids", "after_token_ids must be a non-empty "
                                   "list of token ids.")
        kind, spec = self.key()
        if len(spec) > MAX_SPEC_CHARS:
            raise InvalidParameter(kind, f"{kind} may be at most {MAX_SPEC_CHARS} characters, "
                                   f"got {len(spec)}.")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, spec text): what the compiled grammar depends on (the cache key)."""
        kind = self.kind
        value = getattr(self, kind)
        return kind, _json.dumps(value) if kind == "choice" else str(value)


def from_response_format(value: object) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema",
    "json_schema": {"name", "schema", "strict"}}); None for text. Errors name the field."""
    if not value:
        return None
    if not isinstance(value, dict):
        raise InvalidParameter("response_format", "response_format must be an object.")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidParameter("response_format", "response_format.json_schema.schema "
                                   "must be a JSON schema object.")
        try:
            return StructuredOutputsParams(json=spec["schema"])
        except InvalidParameter as exc:
            raise InvalidParameter("response_format", f"response_format: {exc}") from None
    raise InvalidParameter("response_format", "response_format.type must be text, "
                           "json_object or json_schema.")
