"""What the engine requests made for one API request consumed, for its access-log line: the
API's middleware opens a `RequestRecord` in a context variable, `AsyncLLM.generate` adds to it
(every engine request the handler makes, beams and `n` included), the middleware writes the
line when the response has been sent (`write_line`: HTTP's middleware and the gRPC service)."""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tokenmill.access")

current: ContextVar[RequestRecord | None] = ContextVar("tokenmill_request_record",
                                                       default=None)


@dataclass
class RequestRecord:
    start: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token: float | None = None  # monotonic time of the first generated token
    keep_text: bool = False  # (--log-requests) keep the prompts and outputs below
    prompts: list[list[int]] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    params: Any = None  # the first engine request's SamplingParams (traces)
    metrics: dict | None = None  # the first finished engine request's timestamps (traces)
    headers: dict | None = None  # the HTTP request's (lower-case bytes names and values)
    # what admission read from them (entrypoints/api/state.py): whose share its engine
    # requests run in, and the seconds each may wait to start (0: the engine's limit)
    tenant: str = ""
    max_queue_time: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start


def started(prompt_token_ids: list[int], params: Any = None) -> None:
    record = current.get()
    if record is not None:
        record.prompt_tokens += len(prompt_token_ids)
        if record.keep_text:
            record.prompts.append(list(prompt_token_ids))
        if record.params is None:
            record.params = params


def admission() -> tuple[str, float]:
    """The current API request's tenant and queue-time limit (none outside one)."""
    record = current.get()
    return ("", 0.0) if record is None else (record.tenant, record.max_queue_time)


def keeps_text() -> bool:
    record = current.get()
    return record is not None and record.keep_text


def produced(total, final: bool) -> None:
    """An engine request of the current API request advanced: `total` is its `OutputSum`."""
    record = current.get()
    if record is None:
        return
    if record.first_token is None and total.num_tokens:
        record.first_token = time.monotonic()
    if final:
        if record.metrics is None:
            record.metrics = dict(total.last.metrics or {})
        record.output_tokens += total.num_tokens
        if record.keep_text:
            record.outputs.extend(c.text for c in total.output().outputs)


def write_line(record, request_id: str, method: str, route: str, status, tokenizer=None
               ) -> dict:
    """Logs one request's access line (HTTP, or gRPC: method GRPC, status its code name);
    `tokenizer` given (--log-requests): with the prompt and output text."""
    fields = {"request_id": request_id, "method": method, "route": route, "status": status,
              "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens,
              "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 4),
              "total_s": round(time.monotonic() - record.start, 4)}
    if tokenizer is not None:
        fields["prompt"] = [tokenizer.decode(ids) for ids in record.prompts]
        fields["output"] = record.outputs
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("prompt", "output"))
    if "prompt" in fields:
        text += f" prompt={json.dumps(fields['prompt'], ensure_ascii=False)} " \
                f"output={json.dumps(fields['output'], ensure_ascii=False)}"
    logger.info(text, extra=fields)
    return fields
