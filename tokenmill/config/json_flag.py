"""A flag whose value is a JSON object (`--speculative-config`, `--pooler-config`,
`--limit-mm-per-prompt`, `--override-generation-config`): given as a dict (the `LLM`
arguments) or its JSON text (the command line), checked the one way."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: Any, flag: str, example: str = "") -> dict | None:
    """`value` as a dict; None (or blank text): None. ValueError naming `flag` for text that
    is not JSON or JSON that is not an object (`example`: one shown in that message)."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON: {exc.msg}.") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object{', e.g. ' + example if example else ''}.")
    return value
