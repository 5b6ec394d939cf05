"""The expected queue time behind --max-queue-time's early refusals (engine/queue_wait.py),
against Little's law worked by hand: the requests that start first over the start rate
measured while requests waited (idle time not counted), by policy."""

import types

import pytest

from tokenmill.engine.queue_wait import QueueWait


def stats(admitted, waiting):
    return types.SimpleNamespace(num_admitted=admitted, num_waiting=waiting)


def busy(wait: QueueWait, rate: float, seconds: float, waiting: int = 20, t0: float = 0.0,
         admitted0: int = 0) -> tuple[float, int]:
    """`seconds` of a queue of `waiting` requests starting `rate` a second, observed every
    0.1 s; returns the last (time, count)."""
    t, n = t0, admitted0
    for _ in range(round(seconds * 10)):
        wait.observe(stats(n, waiting), t)
        t, n = t + 0.1, n + round(rate * 0.1)
    wait.observe(stats(n, waiting), t)
    return t, n


def test_nothing_is_estimated_without_a_queue_or_a_measure():
    wait = QueueWait()
    assert wait.estimate_s("default", 0, 0) is None
    wait.observe(stats(0, 5), 0.0)
    wait.observe(stats(1, 5), 0.2)
    assert wait.estimate_s("default", 0, 5) is None  # (0.2 s measured: too little)
    busy(wait, 10, 2.0)
    assert wait.estimate_s("default", 0, 0) is None  # (nothing waits: no wait)


def test_fcfs_little_law_and_idle_time_not_counted():
    wait = QueueWait()
    t, n = busy(wait, rate=10, seconds=3.0)
    assert wait.estimate_s("default", 0, 20) == pytest.approx(21 / 10, rel=0.02)
    wait.observe(stats(n, 0), t + 0.1)  # (the queue drains, then an hour passes idle)
    wait.observe(stats(n + 1, 0), t + 3600)
    wait.observe(stats(n + 1, 20), t + 3600.1)
    assert wait.estimate_s("default", 0, 20) == pytest.approx(21 / 10, rel=0.05)
    busy(wait, rate=40, seconds=60, t0=t + 3600.2, admitted0=n + 1)  # (the rate changed)
    assert wait.estimate_s("default", 0, 20) == pytest.approx(21 / 40, rel=0.05)


def test_priority_counts_those_ahead_of_it():
    wait = QueueWait("priority")
    busy(wait, rate=10, seconds=3.0)
    for i, priority in enumerate([0, 0, 1, 5, 5, 5]):
        wait.entered(f"r{i}", "default", priority)
    assert wait.estimate_s("default", 1, 6) == pytest.approx(4 / 10, rel=0.02)
    assert wait.estimate_s("default", -1, 6) == pytest.approx(1 / 10, rel=0.02)
    wait.left("r0")
    wait.left("r1")
    assert wait.estimate_s("default", 1, 4) == pytest.approx(2 / 10, rel=0.02)


def test_fair_share_counts_its_tenants_queue_at_its_share():
    wait = QueueWait("fair", {"gold": 3})
    busy(wait, rate=10, seconds=3.0)
    for i in range(30):
        wait.entered(f"f{i}", "free", 0)
    # gold has nothing queued: it starts after about one request at 3/4 of the rate
    assert wait.estimate_s("gold", 0, 30) == pytest.approx((1 / 0.75) / 10, rel=0.02)
    # free's 31st request: behind its own 30, at 1/4 (capped by the whole queue)
    assert wait.estimate_s("free", 0, 30) == pytest.approx(31 / 10, rel=0.02)
    for i in range(3):
        wait.entered(f"g{i}", "gold", 0)
    assert wait.estimate_s("gold", 0, 33) == pytest.approx((4 / 0.75) / 10, rel=0.02)
