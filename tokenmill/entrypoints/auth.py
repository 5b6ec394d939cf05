"""The API key check shared by the HTTP and gRPC front ends."""

from __future__ import annotations

import hashlib
import hmac


class ApiKey:
    """`Authorization: Bearer <key>`: the scheme is case-insensitive, the key is matched
    exactly. Both sides are hashed first, so the constant-time comparison does not even
    reveal the key's length (vLLM's AuthenticationMiddleware does the same)."""

    def __init__(self, key: str) -> None:
        self._digest = hashlib.sha256(key.encode()).digest()

    def accepts(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        return self.accepts_key(token.strip()) and scheme.lower() == "bearer"

    def accepts_key(self, token: str | None) -> bool:
        """The key itself (Anthropic's `x-api-key` header)."""
        given = hashlib.sha256((token or "").encode("utf-8", "surrogatepass")).digest()
        return hmac.compare_digest(given, self._digest)
