"""`ApiOptions`: how the API processes answer, set by `tokenmill serve`'s flags (vLLM's
front-end flags, mostly) in server.py and read by the HTTP handlers."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class ApiOptions:
    """How the API processes answer (vLLM's front-end flags, mostly): carried unchanged from
    the server config to each API process (`ApiSettings.config.api`) and its handlers."""
    stream_interval: int = 1  # a stream's chunks: its first tokens, then every N tokens, its end
    max_logprobs: int = 20  # most logprobs / top_logprobs an OpenAI request may ask for
    response_role: str = "assistant"  # chat responses' role
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    tokens_as_ids: bool = False  # OpenAI logprobs show tokens as token_id:N
    request_id_headers: bool = False  # responses carry X-Request-Id
    load_tracking: bool = False  # GET /load
    disable_docs: bool = False  # no /docs, /redoc, /openapi.json
    root_path: str = ""  # the path prefix a proxy serves the API under
    cors: dict | None = None  # CORSMiddleware's arguments (none: no CORS headers)
    tenant_header: str = "X-Tenant-Id"  # names a request's tenant (config/tenants.py)

    def validate(self) -> None:
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be between 0 and 20, got {self.max_logprobs}.")
        if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", self.tenant_header):
            raise ValueError(f"--tenant-header must be an HTTP header name, got "
                             f"{self.tenant_header!r}.")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")
