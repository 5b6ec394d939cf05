"""How long a new request can expect to wait for its first step (`--max-queue-time`: the API
refuses at once, 429 with Retry-After, a request it expects to wait longer, instead of
letting it queue and time out). Little's law: the requests that will start before it over
the rate requests start. The rate is the engines' count of first-scheduled requests
(`SchedulerStats.num_admitted`, every replica and API process included) over the time the
queue was not empty, the past fading with a 10 s time constant; who starts first is the
scheduling policy's, read from what this API process has in flight."""

from __future__ import annotations

import math
from typing import Any

TIME_CONSTANT_S = 10.0
MIN_BUSY_S = 0.5  # queued time measured before any estimate
MIN_STARTED = 2.0  # (decayed) requests seen starting before any estimate


class QueueWait:
    def __init__(self, policy: str = "fcfs", weights: dict[str, float] | None = None) -> None:
        self.policy = policy
        self.weights = weights or {}
        self.waiting: dict[str, tuple[str, int]] = {}  # own requests not started: tenant, prio
        self.busy_s = 0.0  # queued time, faded
        self.started = 0.0  # requests started meanwhile, faded
        self._last: tuple[float, int, int] | None = None  # (time, num_admitted, num_waiting)

    def entered(self, request_id: str, tenant: str, priority: int) -> None:
        self.waiting[request_id] = (tenant, priority)

    def left(self, request_id: str) -> None:
        """Started (its first output) or finished."""
        self.waiting.pop(request_id, None)

    def observe(self, stats: Any, now: float) -> None:
        """The engines' stats (summed over replicas) at `now`: the requests admitted since the
        last ones count towards the rate if requests were waiting then."""
        last = self._last
        if last is not None and last[2] > 0 and now > last[0]:
            dt = now - last[0]
            fade = math.exp(-dt / TIME_CONSTANT_S)
            self.busy_s = self.busy_s * fade + dt
            self.started = self.started * fade + max(0, stats.num_admitted - last[1])
        self._last = (now, stats.num_admitted, stats.num_waiting)

    def estimate_s(self, tenant: str, priority: int, num_waiting: int) -> float | None:
        """The expected wait of a request of `tenant` and `priority` arriving now with
        `num_waiting` requests queued; None: nothing waits, or too little is measured yet."""
        if num_waiting <= 0 or self.busy_s < MIN_BUSY_S or self.started < MIN_STARTED:
            return None
        return self._ahead(tenant, priority, num_waiting) * self.busy_s / self.started

    def _ahead(self, tenant: str, priority: int, num_waiting: int) -> float:
        """Requests expected to start before the new one (it included: it starts after
        them and its own turn)."""
        own = self.waiting.values()
        if self.policy == "priority":
            return min(num_waiting, sum(p <= priority for _, p in own)) + 1
        if self.policy == "fair":  # its tenant's queue, served at the tenant's share
            weight = lambda t: self.weights.get(t, 1.0)  # noqa: E731
            tenants = {t for t, _ in own} | {tenant}
            share = weight(tenant) / sum(weight(t) for t in tenants)
            mine = sum(t == tenant for t, _ in own)
            return min(num_waiting + 1, (mine + 1) / share)
        return num_waiting + 1
