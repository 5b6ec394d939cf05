"""One access line per API request (`AccessLog` middleware: request id, method, route,
status, prompt and output tokens, time to first token, total time; the prompt and output
text only with `--log-requests`); as JSON (`--log-format json`) its fields are top-level
keys of the line (logs.py)."""

from __future__ import annotations

import uuid

from tokenmill.engine import request_log

# Paths whose requests are not logged (probes would drown the requests that matter).
QUIET_PATHS = ("/health", "/v2/health/live", "/v2/health/ready", "/metrics")


class AccessLog:
    """ASGI middleware: one `tokenmill.access` line per HTTP request, written once the last
    byte of its response went out (streams included)."""

    def __init__(self, app, log_requests: bool = False, get_tokenizer=None, tracer=None,
                 model: str | None = None, request_id_header: bool = False) -> None:
        """`request_id_header`: responses carry X-Request-Id (--enable-request-id-headers)."""
        self.app, self.log_requests, self.get_tokenizer = app, log_requests, get_tokenizer
        self.request_id_header = request_id_header
        self.tracer, self.model = tracer, model  # (--otlp-traces-endpoint: tracing.py)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        record = request_log.RequestRecord(keep_text=self.log_requests, headers=headers)
        token = request_log.current.set(record)
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] \
            or uuid.uuid4().hex
        status = 500

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.request_id_header:
                    message = {**message, "headers": [
                        *message.get("headers", []),
                        (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            request_log.current.reset(token)
            tokenizer = self.get_tokenizer() if self.log_requests and self.get_tokenizer \
                else None
            fields = request_log.write_line(record, request_id, scope["method"], scope["path"],
                                            status, tokenizer)
            if self.tracer is not None:
                self.tracer.request_span({k.decode("latin-1"): v.decode("latin-1")
                                          for k, v in headers.items()}, record, fields,
                                         self.model)
