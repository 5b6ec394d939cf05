"""Fair share between tenants (`--scheduling-policy fair`): start-time fair queuing over the
tokens each step computes. A tenant's virtual time grows by its tokens / its weight; the
waiting request admitted next is the first (by priority, then arrival) of the backlogged
tenant with the least virtual time, the step's budget goes to running requests in that order
too, and the request preempted first is one of the tenant with the most. A tenant that
comes back after an idle spell starts at the least virtual time among the active ones: it
is owed nothing for the time it asked for nothing, and it cannot starve the others either.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

MAX_IDLE = 4096  # idle tenants whose virtual time is remembered


class FairShare:
    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.vtime: dict[str, float] = {}
        self.active: Counter[str] = Counter()  # tenant -> its requests in the scheduler

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` entered the scheduler."""
        if not self.active[tenant]:
            floor = min((self.vtime.get(t, 0.0) for t in self.active if self.active[t]),
                        default=0.0)
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), floor)
            if len(self.vtime) > len(self.active) + MAX_IDLE:  # (forget the idle ones)
                self.vtime = {t: v for t, v in self.vtime.items() if self.active[t]
                              or t == tenant}
        self.active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """A request of `tenant` left the scheduler (finished or aborted)."""
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]

    def charge(self, tenant: str, tokens: int) -> None:
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + tokens / self.weight(tenant)

    def key(self, request: Any) -> tuple[float, int, float]:
        """A request's rank (lower: served first): its tenant's virtual time, then its
        priority and arrival."""
        return (self.vtime.get(request.tenant, 0.0), request.priority, request.arrival_time)

    def order(self, waiting: Iterable[Any], scheduled: Iterable[Any]) -> FairOrder:
        return FairOrder(self, waiting, scheduled)


class FairOrder:
    """The waiting requests in the order one step admits them: `peek()` is the first waiting
    request of the tenant whose virtual time, counting what the step gave it so far
    (`scheduled`, then each `take`), is least (ties: by tenant name)."""

    def __init__(self, share: FairShare, waiting: Iterable[Any], scheduled: Iterable[Any]):
        self.share = share
        self.queues: dict[str, deque] = {}
        for request in waiting:
            self.queues.setdefault(request.tenant, deque()).append(request)
        self.step: Counter[str] = Counter()
        for s in scheduled:
            self.step[s.request.tenant] += s.num_new_tokens
        self.heap = [(self._vtime(t), t) for t in self.queues]
        heapq.heapify(self.heap)

    def _vtime(self, tenant: str) -> float:
        return self.share.vtime.get(tenant, 0.0) + self.step[tenant] / self.share.weight(tenant)

    def peek(self) -> Any:
        return self.queues[self.heap[0][1]][0] if self.heap else None

    def take(self, request: Any, tokens: int) -> None:
        """`request` (the one `peek` gave) leaves the order with `tokens` this step."""
        tenant = request.tenant
        queue = self.queues[tenant]
        queue.popleft()
        self.step[tenant] += tokens
        heapq.heappop(self.heap)
        if queue:
            heapq.heappush(self.heap, (self._vtime(tenant), tenant))
