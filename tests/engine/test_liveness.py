"""The stall rule (`engine/liveness.py`) on a clock the test moves: a step is judged by what
steps of its size took before, never by a fixed interval alone."""

import pytest

from tokenmill.engine import liveness
from tokenmill.engine.liveness import STALL_FACTOR, EngineHeartbeat, Liveness, StepClock


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(liveness, "time", fake)
    return fake


def run_step(steps: StepClock, clock: FakeClock, tokens: int, seconds: float) -> None:
    steps.start(tokens)
    clock.now += seconds
    steps.stop()


def test_expected_duration_scales_smaller_steps_up_and_never_larger_ones_down(clock):
    steps = StepClock()
    assert steps.expected(100) is None
    run_step(steps, clock, 10, 0.02)  # 2 ms a token
    run_step(steps, clock, 1000, 0.5)  # a prompt chunk: 0.5 ms a token
    assert steps.expected(100) == pytest.approx(0.5)  # the larger step, as it was
    assert steps.expected(2000) == pytest.approx(4.0)  # the small step's rate, scaled up
    assert steps.expected(1) == pytest.approx(0.5)


def test_heartbeat_reports_the_running_step(clock):
    steps = StepClock()
    run_step(steps, clock, 8, 0.1)
    assert not steps.heartbeat().step_running
    steps.start(16)
    clock.now += 0.3
    beat = steps.heartbeat()
    assert beat.step_running and beat.step_tokens == 16
    assert beat.step_elapsed_s == pytest.approx(0.3)
    assert beat.step_expected_s == pytest.approx(0.2)


def test_a_long_step_of_its_size_is_not_a_stall_but_one_far_beyond_is(clock):
    alive = Liveness(dead_after_s=1.0)
    # 12 s into a step expected to take 2 s: far past the 1 s interval, but under 10 x 2 s.
    alive.beat(EngineHeartbeat(True, 12.0, 2048, 2.0))
    assert alive.problem() is None
    clock.now += 0.5
    alive.beat(EngineHeartbeat(True, 19.8, 2048, 2.0))
    assert alive.problem() is None
    clock.now += 0.3  # between heartbeats the step's age is extrapolated: 20.1 s > 20 s
    assert "past its limit of 20.0 s" in alive.problem()


def test_the_limit_never_drops_below_the_interval_and_is_generous_before_any_step(clock):
    alive = Liveness(dead_after_s=3.0)
    tiny = EngineHeartbeat(True, 2.9, 4, 0.001)
    assert alive.stall_limit(tiny) == 3.0
    first = EngineHeartbeat(True, 0.0, 4, None)
    assert alive.stall_limit(first) == STALL_FACTOR * 3.0


def test_silence_is_death_and_outputs_count_as_signs_of_life(clock):
    alive = Liveness(dead_after_s=2.0)
    clock.now += 1.9
    assert alive.problem() is None
    alive.seen()
    clock.now += 1.9
    assert alive.problem() is None
    clock.now += 0.2
    assert "no heartbeat" in alive.problem()
