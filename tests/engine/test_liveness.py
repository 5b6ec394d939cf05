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


def test_a_step_is_a_stall_only_past_the_iteration_timeout(clock):
    """A 1-token step expected to take 10 ms: with a 10 s interval it once counted as a
    stall at 10 s (a busy machine, a slow constraint); the floor is now the iteration
    timeout (VLLM_ENGINE_ITERATION_TIMEOUT_S, 60 s in a server)."""
    alive = Liveness(dead_after_s=10.0, stall_after_s=60.0)
    alive.beat(EngineHeartbeat(True, 15.2, 1, 0.01))
    assert alive.problem() is None
    assert alive.stall_limit(EngineHeartbeat(True, 0.0, 1, 0.01)) == 60.0
    assert alive.stall_limit(EngineHeartbeat(True, 0.0, 4096, 8.0)) == STALL_FACTOR * 8.0
    alive.beat(EngineHeartbeat(True, 60.5, 1, 0.01))
    assert "past its limit of 60.0 s" in alive.problem()


def test_a_held_event_loop_is_not_taken_for_a_silent_engine(monkeypatch):
    """The API process's own loop held for longer than the interval (its heartbeats unread
    meanwhile): the next check does not judge; the one after it does, on what was read."""
    import asyncio

    from tokenmill.engine import async_engine

    fake = FakeClock()
    monkeypatch.setattr(liveness, "time", fake)
    monkeypatch.setattr(async_engine, "time", fake)

    class Client:
        num_replicas = 1

    engine = async_engine.AsyncLLM(Client(), None, [0], dead_after_s=2.0)
    asyncio.run(engine.check_health())
    assert engine.dead is None
    fake.now += 14.7  # the loop was held: no check, no heartbeat read
    asyncio.run(engine.check_health())
    assert engine.dead is None  # not judged on unread heartbeats
    engine.liveness[0].beat(EngineHeartbeat())  # read as soon as the loop ran
    for _ in range(3):
        fake.now += 0.5
        asyncio.run(engine.check_health())
    assert engine.dead is None  # 1.5 s of silence, under the 2 s interval
    fake.now += 0.6
    asyncio.run(engine.check_health())
    assert engine.dead is not None  # a silence the loop saw through is death
