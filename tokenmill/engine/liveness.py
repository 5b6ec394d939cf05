"""Telling a busy engine from a dead or stalled one.

The engine-core process sends an `EngineHeartbeat` from a thread of its own every
`HEARTBEAT_S`, whatever its loop is doing: a heartbeat proves the process is alive and says
whether a step is running, how long it has run and how long steps of its size took before
(`StepClock`). The API side (`Liveness`) then declares the engine

- dead when no heartbeat came for `dead_after_s` (CHECK_HEALTH_INTERVAL): the process is
  gone, frozen or cannot run a thread;
- stalled when the running step is far past what steps of its size took:
  `max(stall_after_s, STALL_FACTOR x expected)`, where `expected` scales the recent steps'
  durations up to this step's token count (never down) and `stall_after_s` is
  VLLM_ENGINE_ITERATION_TIMEOUT_S (60 s in a server). With nothing measured yet, the limit
  is at least STALL_FACTOR x dead_after_s.

So a step slowed by a busy machine, a long prompt chunk or a cold cache is never taken for a
stall: the steps measured before it were slowed too, and the limit scales with its size."""

from __future__ import annotations

import collections
import time

import msgspec

HEARTBEAT_S = 0.5
STALL_FACTOR = 10.0
_WINDOW = 64  # recent steps the expected duration is taken from


class EngineHeartbeat(msgspec.Struct, array_like=True):
    step_running: bool = False
    step_elapsed_s: float = 0.0
    step_tokens: int = 0
    step_expected_s: float | None = None  # None: no step measured yet


class StepClock:
    """Times the engine's steps (its loop thread calls start/stop: a few attribute writes, so
    a step pays nothing for it); `heartbeat()` may be called from any thread: it reads one
    tuple, replaced whole, and a copy of the recent durations (taken whole under the GIL),
    and works out the expected duration there."""

    def __init__(self) -> None:
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=_WINDOW)
        self._current: tuple[float, int] | None = None  # the running step: start, tokens

    def expected(self, tokens: int, recent=None) -> float | None:
        """What a step of `tokens` should take, from the recent ones: each scaled up
        linearly to `tokens` if it was smaller, taken as is if it was larger; the largest."""
        recent = self._recent if recent is None else recent
        if not recent:
            return None
        return max(d * max(1.0, tokens / max(n, 1)) for n, d in recent)

    def start(self, tokens: int) -> None:
        self._current = (time.monotonic(), tokens)

    def stop(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            self._recent.append((current[1], time.monotonic() - current[0]))

    def heartbeat(self) -> EngineHeartbeat:
        current = self._current
        if current is None:
            return EngineHeartbeat()
        started, tokens = current
        return EngineHeartbeat(True, time.monotonic() - started, tokens,
                               self.expected(tokens, tuple(self._recent)))


class Liveness:
    """The API side's view of the engine from its heartbeats and outputs."""

    def __init__(self, dead_after_s: float, stall_after_s: float | None = None) -> None:
        """`stall_after_s`: the least a step may run before it is a stall (None: as long as
        `dead_after_s`)."""
        self.dead_after_s = dead_after_s
        self.stall_after_s = dead_after_s if stall_after_s is None else stall_after_s
        self.last_seen = time.monotonic()
        self.heartbeat: EngineHeartbeat | None = None
        self._heartbeat_at = self.last_seen

    def seen(self) -> None:
        """Outputs arrived (the loop is moving)."""
        self.last_seen = time.monotonic()

    def beat(self, heartbeat: EngineHeartbeat) -> None:
        self.heartbeat = heartbeat
        self.last_seen = self._heartbeat_at = time.monotonic()

    def stall_limit(self, heartbeat: EngineHeartbeat) -> float:
        if heartbeat.step_expected_s is None:
            return max(self.stall_after_s, STALL_FACTOR * self.dead_after_s)
        return max(self.stall_after_s, STALL_FACTOR * heartbeat.step_expected_s)

    def problem(self) -> str | None:
        """None while the engine is alive and not stalled; else what is wrong."""
        now = time.monotonic()
        if now - self.last_seen >= self.dead_after_s:
            return f"no heartbeat from the engine core for {now - self.last_seen:.1f} s"
        hb = self.heartbeat
        if hb is not None and hb.step_running:
            elapsed = hb.step_elapsed_s + (now - self._heartbeat_at)
            limit = self.stall_limit(hb)
            if elapsed > limit:
                return (f"an engine step of {hb.step_tokens} tokens has run {elapsed:.1f} s, "
                        f"past its limit of {limit:.1f} s")
        return None

    def step_running_s(self) -> float | None:
        """How long the current engine step has run (None when idle or unknown)."""
        hb = self.heartbeat
        if hb is None or not hb.step_running:
            return None
        return hb.step_elapsed_s + (time.monotonic() - self._heartbeat_at)
