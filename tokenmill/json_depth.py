"""How deep JSON text nests, counted at C speed before the recursive code that reads it
(templates, schema compilation, logging) spends its stack: request bodies and JSON-schema
constraints are bounded with it."""

from __future__ import annotations

import re

# Arrays and objects inside one another (serde_json's default recursion limit is 128 too): a
# JSON schema or a tool's parameters nest a few levels each, and anything deeper only costs
# the code after the parser its stack.
MAX_JSON_DEPTH = 128

# A JSON string literal (escapes included), then every byte that is not a bracket.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nests_deeper(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays and objects nest more than `limit` deep in the well-formed JSON text
    `raw`, at C speed (no Python loop over the text): strings dropped, the brackets left
    counted +1 / -1."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the common case: it cannot
        return False
    import numpy as np

    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return bool(steps.size) and int(np.cumsum(steps).max()) > limit
