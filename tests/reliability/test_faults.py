"""Catalogue F1-F3 and F8-F10 on service apps over engine-core processes (fast); the process
tree faults (F5-F7, F11) are in test_process_faults.py."""

import contextlib
import threading
import time

import httpx
import pytest

from tests.reliability.checks import assert_openai_error
from tests.reliability.streams import Stream, leave_all, long_body, open_raw_stream
from tests.serving import (
    HOLD_TOKENS,
    service_over_engine,
    wait_until,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@contextlib.contextmanager
def engine_app(tiny_models, metrics=True, arch="llama", **engine):
    """A running service app over its own engine-core process (limits for one test)."""
    from tokenmill.config.engine import EngineConfig
    from tokenmill.metrics import Metrics

    path = tiny_models(arch)[0]
    max_waiting = engine.pop("max_cached_task_num", 64)
    max_num_seqs = engine.get("max_num_seqs", EngineConfig.max_num_seqs)  # the default
    registry = Metrics("tiny", max_num_seqs) if metrics else None
    with service_over_engine(path, registry, engine, max_dec_len=256,
                             max_cached_task_num=max_waiting) as thread:
        yield thread


@pytest.fixture(scope="module")
def small(tiny_models):
    """Two running slots and eight waiting ones (F2, F8), on the long-context model: room
    for requests that are still running whenever the test looks (HOLD_TOKENS)."""
    with engine_app(tiny_models, arch="llama_long", max_num_seqs=2,
                    max_cached_task_num=8) as thread:
        yield thread


def sample(metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels})
    return value or 0.0


# F1 -----------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_everything(long_server):
    engine, server = long_server.app.state.server.engine, long_server.base
    aborted_before = engine.num_aborted
    # The 16 that leave ask for HOLD_TOKENS (so they cannot finish before the server sees
    # them go, however fast the engine); the 16 that stay, 60.
    streams = [Stream(server, long_body(i, HOLD_TOKENS if i % 2 else 60),
                      leave_after=3 if i % 2 else None, rst=i % 4 == 1) for i in range(32)]
    for s in streams:
        s.start()
    for s in streams:
        s.join(120)
        assert not s.is_alive()
    assert wait_until(lambda: engine.num_in_flight() == 0 and engine.stats.num_running == 0
                      and engine.stats.kv_blocks_used == 0, 10)
    assert engine.num_aborted - aborted_before == 16
    # The survivors were not disturbed: each equals its run alone.
    for s in streams[::2][:4]:
        alone = httpx.post(server + COMPLETIONS, json=s.body, timeout=120).json()
        assert s.text() == alone["choices"][0]["text"]


# F3 -----------------------------------------------------------------------------------------
def test_non_streaming_client_timeout_aborts_the_request(long_server):
    engine = long_server.app.state.server.engine
    aborted_before = engine.num_aborted
    # 32 prompts x HOLD_TOKENS: far longer than the client waits.
    body = {**long_body(0, HOLD_TOKENS), "prompt": [f"story {i}" for i in range(32)]}
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(long_server.base + COMPLETIONS, json=body, timeout=0.2)
    assert wait_until(lambda: engine.num_in_flight() == 0
                      and engine.stats.kv_blocks_used == 0, 10)
    assert engine.num_aborted - aborted_before == 3 * 32  # one engine request per prompt


# F2 / F8 ------------------------------------------------------------------------------------
def test_disconnect_while_queued_leaves_the_queue_at_once(small):
    engine = small.app.state.server.engine
    running = [Stream(small.base, long_body(i, HOLD_TOKENS)) for i in range(2)]
    for s in running:
        s.start()
    assert wait_until(lambda: engine.stats.num_running == 2, 30)
    queued = [open_raw_stream(small.base, long_body(10 + i)) for i in range(4)]
    assert wait_until(lambda: engine.stats.num_waiting == 4, 30)
    prompt_tokens = engine.stats.prefix_queried_tokens
    for sock in queued:
        sock.close()
    # They leave without ever being scheduled (the two running hold every slot, whatever the
    # machine's speed): the bound only guards against a hang.
    assert wait_until(lambda: engine.stats.num_waiting == 0, 60)
    assert engine.stats.num_running == 2
    # Never prefilled: no prompt of theirs was looked up in the prefix cache.
    assert engine.stats.prefix_queried_tokens == prompt_tokens
    for s in running:  # undisturbed: still streaming tokens
        seen = len(s.lines)
        assert wait_until(lambda: len(s.lines) > seen + 10)  # noqa: B023 - used at once
        s.leave.set()
        s.join(60)
        assert s.status == 200 and not any('"error"' in line for line in s.lines)


def test_queue_full_rejects_fast_all_or_nothing(small):
    state = small.app.state.server
    rejected_before = sample(small.metrics, "tokenmill:request_rejected_total",
                             reason="queue_full")
    # 30 at once, each running until the test lets go (HOLD_TOKENS): 2 run, 8 wait, and
    # the other 20 are refused with 503 at once.
    streams = [Stream(small.base, long_body(i, HOLD_TOKENS)) for i in range(30)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.answered.wait(60)
    accepted = [s for s in streams if s.status == 200]
    refused = [s for s in streams if s.status == 503]
    assert len(accepted) == 10 and len(refused) == 20
    for s in refused:  # refused at once: answered while every accepted stream still runs
        s.join(60)
        assert_openai_error(s.response(), 503)
    assert all(s.is_alive() and s.status == 200 for s in accepted)
    leave_all(accepted)
    rejected = sample(small.metrics, "tokenmill:request_rejected_total", reason="queue_full")
    assert rejected - rejected_before == 20
    # What a refusal costs the server: one kept-alive client, the queue held full (patched:
    # real requests that fill it could finish mid-measurement on a fast machine), against
    # the cheapest route on the same connection, interleaved, so a busy machine slows both.
    original_queue_full = state.queue_full
    state.queue_full = lambda slots=1: True
    try:
        with httpx.Client(timeout=60) as client:
            times, probes = [], []
            for _ in range(100):
                start = time.perf_counter()
                resp = client.post(small.base + COMPLETIONS, json=long_body(0, 4))
                times.append((time.perf_counter() - start) * 1e3)
                assert resp.status_code == 503
                start = time.perf_counter()
                assert client.get(small.base + "/health").status_code == 200
                probes.append((time.perf_counter() - start) * 1e3)
    finally:
        state.queue_full = original_queue_full
    times.sort()
    probes.sort()
    print(f"refusal with the queue full: p50 {times[49]:.1f} ms, p99 {times[98]:.1f} ms; "
          f"/health p50 {probes[49]:.1f} ms")
    assert times[49] < 10 * probes[49] + 5, (times[49], probes[49])
    # n counts as n slots, all or nothing: 3 x (n=3) fit 9 of 10 slots, a 4th does not.
    assert wait_until(lambda: state.engine.num_in_flight() == 0, 30)
    streams = [Stream(small.base, {**long_body(i, HOLD_TOKENS), "n": 3}) for i in range(3)]
    for s in streams:
        s.start()
    assert wait_until(lambda: state.engine.num_in_flight_sequences() == 9, 30)
    resp = httpx.post(small.base + COMPLETIONS, json={**long_body(9, 5), "n": 3}, timeout=30)
    assert_openai_error(resp, 503)
    one = Stream(small.base, long_body(9, HOLD_TOKENS))
    one.start()
    assert one.answered.wait(60) and one.status == 200  # one slot was still free
    leave_all([*streams, one])



# F9 / F10 -----------------------------------------------------------------------------------
def test_kv_exhaustion_preempts_and_every_request_completes(tiny_models):
    with engine_app(tiny_models, metrics=False, max_model_len=512, num_kv_blocks=16,
                    block_size=16) as thread:
        base, app = thread.base, thread.app
        bodies = [long_body(i, 100) for i in range(4)]  # 4 x ~8 blocks > 16
        out: dict = {}

        def run(i):
            out[i] = httpx.post(base + COMPLETIONS, json=bodies[i], timeout=300).json()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stats = app.state.server.engine.stats
        assert stats.num_preemptions > 0
        for i in range(4):  # identical to the same request alone
            alone = httpx.post(base + COMPLETIONS, json=bodies[i], timeout=120).json()
            assert out[i]["choices"][0]["text"] == alone["choices"][0]["text"]
        # F10: more than the whole cache (256 tokens) is refused, never queued.
        resp = httpx.post(base + COMPLETIONS, json=long_body(0, 300), timeout=60)
        error = assert_openai_error(resp, 400, "max_tokens")
        assert "maximum context length is 256" in error["message"]
