"""OpenAI's `response_format` as a `StructuredOutputsParams` (the OpenAI and native APIs)."""

from __future__ import annotations

from tokenmill.sampling_params import InvalidParameter, StructuredOutputsParams


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
