"""JSON request bodies, transport-free: the one parser every route (HTTP and gRPC) uses, strict
where Python's `json` is lenient (no NaN / Infinity, no lone surrogates), and the body size
limit's default."""

from __future__ import annotations

import json
import re

from tokenmill.json_depth import MAX_JSON_DEPTH, nests_deeper

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # TGI's --payload-limit is 2 MB too


class BodyError(ValueError):
    """The body is not a JSON object (each API words the error response its own way)."""


# A lone surrogate (\ud800 without its pair) parses to a str no tokenizer can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes):
    """Strict JSON from the wire: UTF-8 (RFC 8259; a BOM is allowed), no NaN / Infinity
    literals (not JSON, and a NaN temperature would pass every range check), arrays and
    objects nested at most MAX_JSON_DEPTH deep, no unpaired UTF-16 surrogate escapes (a
    `\\ud800` parses to a str no tokenizer can encode). Raises BodyError."""
    try:
        # raw.decode, not json.loads(bytes): that decodes with "surrogatepass" and would let
        # UTF-8-encoded surrogates (b"\xed\xa0\x80") through.
        value = json.loads(raw.decode("utf-8-sig"), parse_constant=_no_constants)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
        raise BodyError("The request body is not valid JSON.") from None
    if nests_deeper(raw):
        raise BodyError(f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} "
                        "levels deep.")
    if _SURROGATE_ESCAPE.search(raw):  # rare: pay for the full check only then
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BodyError("The request body contains an unpaired UTF-16 surrogate "
                            "escape (\\ud800-\\udfff); text must be valid Unicode.") from None
    return value


def parse_json_object(raw: bytes) -> dict:
    """`parse_json`, and the value must be an object (every HTTP route's body)."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BodyError("The request body must be a JSON object.")
    return body
