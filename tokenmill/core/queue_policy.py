"""`QueuePolicy` (`--scheduling-policy`): the order requests wait in, which running request
is preempted first, and whether a waiting one may take a running one's place. "fcfs":
arrival order, the newest preempted. "priority" (vLLM's): (priority, arrival) order, the
last in it preempted, and a waiting request that ranks ahead of a running one displaces
it. "fair": tenants share the tokens by weight (core/fair_share.py), each tenant's
requests in (priority, arrival) order; nobody is displaced (a tenant behind its share
gets the next free slot instead)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from tokenmill.core.fair_share import FairOrder, FairShare


class QueuePolicy:
    def __init__(self, policy: str, tenant_weights: dict[str, float] | None = None) -> None:
        self.policy = policy
        self.fair = FairShare(tenant_weights or {}) if policy == "fair" else None

    @staticmethod
    def key(request: Any) -> tuple[int, float]:
        return (request.priority, request.arrival_time)

    def wait(self, waiting: deque, request: Any, front: bool = False) -> None:
        """`request` into `waiting`: FCFS at the back (`front`: a preempted request, first);
        otherwise at its place in (priority, arrival) order."""
        if self.policy == "fcfs":
            (waiting.appendleft if front else waiting.append)(request)
            return
        key, i = self.key(request), len(waiting)
        while i > 0 and self.key(waiting[i - 1]) > key:
            i -= 1
        waiting.insert(i, request)

    def victim(self, running: list) -> Any:
        """The running request to preempt."""
        if self.fair is not None:
            return max(running, key=self.fair.key)
        if self.policy != "priority":
            return running[-1]
        return max(running, key=self.key)

    def ranks_ahead(self, running: list, request: Any) -> bool:
        """Whether waiting `request` may displace a running request (priority policy: one
        ranks behind it)."""
        return (self.policy == "priority" and bool(running)
                and self.key(self.victim(running)) > self.key(request))

    # ---- fair share (no-ops under the other policies) ---------------------------------
    def arrived(self, request: Any) -> None:
        if self.fair is not None:
            self.fair.arrive(request.tenant)

    def left(self, request: Any) -> None:
        if self.fair is not None:
            self.fair.leave(request.tenant)

    def charge(self, request: Any, tokens: int) -> None:
        if self.fair is not None:
            self.fair.charge(request.tenant, tokens)

    def sort_running(self, running: list) -> None:
        """The step's budget goes to the least-served tenants' requests first."""
        if self.fair is not None:
            running.sort(key=self.fair.key)

    def admission_order(self, waiting: deque, scheduled: Iterable[Any]) -> FairOrder | None:
        """Fair share: the order a step admits waiting requests in (None: `waiting`'s)."""
        return self.fair.order(waiting, scheduled) if self.fair is not None else None
