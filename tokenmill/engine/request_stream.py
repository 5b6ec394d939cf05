"""One request's results on their way from the output loop to its reader (`RequestStream`:
batched by the stream interval) and its latencies into the metrics (`RequestTimer`)."""

from __future__ import annotations

import asyncio
import time

from tokenmill.metrics import Metrics
from tokenmill.outputs import RequestOutput


class RequestStream:
    """One request's results on their way to its reader (or the error that ends it). The
    reader wakes for every result, or with an interval for the first one with tokens, then
    once `interval` tokens are held, and for the last one or an error. Each result's tokens
    reach the metrics as it arrives, however long it is held."""

    __slots__ = ("timer", "interval", "items", "ready", "held", "started")

    def __init__(self, timer: RequestTimer, interval: int) -> None:
        self.timer, self.interval = timer, interval
        self.items: list = []
        self.ready = asyncio.Event()
        self.held = 0  # tokens held back
        self.started = False  # its first tokens were handed on

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        if isinstance(item, RequestOutput):
            new = self.timer.output(item)
            if self.interval > 1 and not item.finished:
                self.held += new
                if self.held < self.interval and (self.started or not new):
                    return
                self.started, self.held = True, 0
        self.ready.set()

    async def take(self) -> list:
        """Every result since the last take, once there is one to hand on."""
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


class RequestTimer:
    """Feeds one request's latencies into the metrics (no-op without metrics)."""

    def __init__(self, metrics: Metrics | None, num_prompt_tokens: int,
                 tenant: str = "default") -> None:
        """`tenant`: the request's tenant as the metrics label it (config/tenants.py)."""
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.tenant = tenant
        self.start = self.last = time.monotonic()
        self.num_tokens = 0
        self.done = False
        if metrics is not None:
            metrics.request_started()

    def ended(self, disconnected: bool) -> None:
        if self.metrics is not None:
            self.metrics.request_ended(disconnected)

    def output(self, delta: RequestOutput) -> int:
        """Observes a result as it arrives; returns its new tokens."""
        new = sum(len(c.token_ids) for c in delta.outputs)
        if self.metrics is None:
            return new
        now = time.monotonic()
        if new:
            self.metrics.tokens_generated(new)
            if self.num_tokens == 0:
                self.metrics.first_token(now - self.start)
            else:
                self.metrics.inter_token(now - self.last)
            self.num_tokens, self.last = self.num_tokens + new, now
        if delta.finished:
            reasons = {c.finish_reason for c in delta.outputs}
            self.finish("length" if reasons == {"length"} else "stop")
        return new

    def finish(self, outcome: str) -> None:
        if self.metrics is None or self.done:
            return
        self.done = True
        self.metrics.request_finished(outcome, self.num_prompt_tokens, self.num_tokens,
                                      time.monotonic() - self.start)
        self.metrics.tenant_request(self.tenant, outcome, self.num_prompt_tokens,
                                    self.num_tokens)
