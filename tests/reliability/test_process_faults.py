"""Catalogue F5-F7 and F11 on `tokenmill serve` process trees (crash, stall, a slow engine,
drain, start-up failure), P2 along the way (liveness and readiness through the lifecycle)."""

import os
import pathlib
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.reliability.checks import assert_openai_error, sse_events
from tests.reliability.streams import COMPLETIONS, Stream, long_body, streaming
from tests.serving import DRAIN_TOKENS, HOLD_TOKENS, Served, alive, children, wait_until

FAULTS = str(pathlib.Path(__file__).parent / "faults")


# Process-tree faults --------------------------------------------------------------------------
@pytest.fixture
def model(tiny_models):
    """The long-context model: requests that outlast whatever the test does meanwhile."""
    return tiny_models("llama_long")[0]


def faulty(model, tmp_path, fault: str, *flags: str) -> Served:
    served = Served(model, tmp_path, *flags)
    served.env["PYTHONPATH"] = os.pathsep.join(
        [FAULTS, str(pathlib.Path(__file__).parents[2]), served.env.get("PYTHONPATH", "")])
    served.env["TOKENMILL_TEST_FAULT"] = fault
    return served


def grpc_ready(served) -> tuple[bool, bool]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
    try:
        return client.is_server_ready(), client.is_model_ready("tiny")
    except Exception:  # noqa: BLE001 - gone is not ready
        return False, False
    finally:
        client.close()


def check_clean_exit(served, kids, code: int) -> None:
    assert served.process.wait(120) == code
    assert wait_until(lambda: not any(alive(pid) for pid in kids), 60)
    assert wait_until(served.ports_free, 60)


@pytest.mark.parametrize("fault", ["crash:40", "hang:40"])
def test_engine_crash_or_stall_fails_requests_and_exits_nonzero(model, tmp_path, fault):
    """F5 (exception in the forward) and F6 (the forward never returns; stall timeout 3 s):
    in-flight requests get errors, readiness goes false everywhere, the server exits 1 and
    leaves nothing behind (documented policy: a supervisor restarts it)."""
    served = faulty(model, tmp_path, fault)
    served.env["CHECK_HEALTH_INTERVAL"] = "3"
    served.env["VLLM_ENGINE_ITERATION_TIMEOUT_S"] = "3"  # (60 s by default)
    stamp = tmp_path / "fault-time"
    served.env["TOKENMILL_TEST_FAULT_STAMP"] = str(stamp)
    served.start()
    try:
        served.wait_ready()
        assert grpc_ready(served) == (True, True)
        kids = children(served.process.pid)
        streams = [Stream(served.api, long_body(i)) for i in range(3)]
        for s in streams:
            s.start()
        whole: dict = {}
        waiter = threading.Thread(target=lambda: whole.setdefault(
            "r", httpx.post(served.api + COMPLETIONS, json=long_body(7), timeout=60)))
        waiter.start()
        for s in streams:
            s.join(300)  # bounds a hang only
        waiter.join(300)
        # From the fault to the last in-flight stream's error (printed: seconds on an idle
        # machine). A hang must not be declared before the stall timeout (3 s here).
        struck = float(stamp.read_text())
        latency = max(s.ended_at for s in streams) - struck
        print(f"{fault}: every in-flight request failed {latency:.2f} s after the fault")
        if fault.startswith("hang"):
            assert min(s.ended_at for s in streams) - struck >= 3.0
        for s in streams:
            events, done = sse_events(s.lines)
            assert done == 1 and "error" in events[-1], events[-1:]
            assert events[-1]["error"]["code"] == 503
        assert_openai_error(whole["r"], 503)
        check_clean_exit(served, kids, 1)
    finally:
        served.stop()
    output = served.process.stdout.read().decode()
    assert "engine core died" in output or "stopped responding" in output, output[-2000:]


def test_sigterm_with_zero_drain_timeout_ends_streams_and_exits_fast(model, tmp_path):
    """F7 with --shutdown-timeout 0, and P2's draining state."""
    served = Served(model, tmp_path, "--shutdown-timeout", "0").start()
    try:
        served.wait_ready()
        kids = children(served.process.pid)
        streams = streaming(served.api, [long_body(i, HOLD_TOKENS) for i in range(4)])
        start = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(120)  # bounds a hang only: the order below is what is checked
        code = served.process.wait(120)
        print(f"drain timeout 0: exit {code} {time.monotonic() - start:.2f} s after SIGTERM")
        assert code == 0
        for s in streams:
            # Cut by the shutdown, not drained: far from their HOLD_TOKENS (~30 s on an idle
            # machine), and ended by the shutdown's error rather than a finish reason.
            events, done = sse_events(s.lines)
            assert done == 1 and events[-1]["error"]["code"] == 503
            assert "shut down" in events[-1]["error"]["message"]
            assert len(events) < HOLD_TOKENS // 2
        check_clean_exit(served, kids, 0)
    finally:
        served.stop()


def test_health_through_the_lifecycle_and_drain_with_timeout(model, tmp_path):
    """P2: starting (live, not ready), ready, draining (live, not ready; KServe agrees;
    new requests 503; in-flight ones complete), exit 0."""
    # The drain timeout only has to outlast the streams, however slow the machine.
    served = Served(model, tmp_path, "--shutdown-timeout", "600").start()
    try:
        def probes():
            try:
                live = httpx.get(served.health + "/v2/health/live", timeout=10).status_code
                ready = httpx.get(served.health + "/v2/health/ready", timeout=10).status_code
                return live, ready
            except httpx.TransportError:
                return None, None

        assert wait_until(lambda: probes()[0] == 200, 60)
        # While the model loads: live, not ready (unless loading already finished).
        assert probes() in ((200, 503), (200, 200))
        served.wait_ready()
        assert probes() == (200, 200) and grpc_ready(served) == (True, True)
        kids = children(served.process.pid)
        # In flight for seconds (DRAIN_TOKENS), so the draining state is there to see.
        streams = streaming(served.api, [long_body(i, DRAIN_TOKENS) for i in range(4)])
        served.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: probes() == (200, 503), 60)
        assert grpc_ready(served) == (False, False)
        refused = httpx.post(served.api + COMPLETIONS, json=long_body(9, 2), timeout=60)
        assert_openai_error(refused, 503)
        for s in streams:
            s.join(600)
            events, done = sse_events(s.lines)
            assert done == 1 and "choices" in events[-1], events[-1]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        check_clean_exit(served, kids, 0)
    finally:
        served.stop()


# F11 ----------------------------------------------------------------------------------------
def test_startup_failures_exit_nonzero_with_a_clear_message(model, tmp_path):
    bad = Served(str(tmp_path / "no-such-model"), tmp_path).start()
    try:
        assert bad.process.wait(60) != 0
        output = bad.process.stdout.read().decode()
        assert "no-such-model" in output
        assert bad.ports_free()
    finally:
        bad.stop()
    busy = Served(model, tmp_path)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", busy.ports["port"]))
        blocker.listen(1)
        busy.start()
        try:
            assert busy.process.wait(300) != 0  # bounds a hang only
            output = busy.process.stdout.read().decode()
            # Refused before anything was loaded: the port check comes first.
            assert "loading" not in output, output[-2000:]
            assert str(busy.ports["port"]) in output and "Traceback" not in output
        finally:
            busy.stop()


def test_a_slow_engine_step_is_not_taken_for_a_stall(model, tmp_path):
    """A step far longer than CHECK_HEALTH_INTERVAL that is making progress is not a stall:
    every forward is slowed in proportion to its tokens (5 ms a token, as a busy CPU slows
    it), so a 600-token prompt's step runs >= 3 s against a 1 s interval. The request
    completes, readiness stays true throughout, and SIGTERM still ends the server with 0.
    (Before the heartbeat thread, the supervisor took that step for a dead engine.)"""
    served = faulty(model, tmp_path, "slow:5")
    served.env["CHECK_HEALTH_INTERVAL"] = "1"
    with served.running():
        warm = httpx.post(served.api + COMPLETIONS, json=long_body(0, 4), timeout=60)
        assert warm.status_code == 200, warm.text
        probes: list[int] = []
        done = threading.Event()

        steps: list[float] = []

        def probe() -> None:
            while not done.is_set() and len(probes) < 10_000:
                resp = httpx.get(served.health + "/v2/health/ready", timeout=30)
                probes.append(resp.status_code)
                steps.append(resp.json().get("engine_step_running_s", 0.0))
                done.wait(0.1)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        start = time.monotonic()
        body = {"model": "tiny", "prompt": [10 + i % 300 for i in range(600)], "max_tokens": 4,
                "ignore_eos": True, "temperature": 0}
        resp = httpx.post(served.api + COMPLETIONS, json=body, timeout=120)
        took = time.monotonic() - start
        done.set()
        prober.join(60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        assert took >= 3.0  # the slow step really outlasted the interval three times
        assert probes and set(probes) == {200}, probes
        assert max(steps) > 1.0  # readiness showed the long step running, past the interval
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60) == 0
    output = served.process.stdout.read().decode()
    assert "declared dead" not in output and "engine core died" not in output, output[-2000:]


def test_ten_busy_processes_and_heavy_constraints_keep_the_engine(model, tmp_path):
    """The hostile pass's case: a machine loaded ~10 deep on its cores, constrained requests
    compiling and masking (deep schemas, long and nested repetitions, and the regexes past
    the bounds, refused), and the default CHECK_HEALTH_INTERVAL of 10 s. The engine is never
    declared dead, every bystander is answered, readiness holds, SIGTERM still exits 0."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    schema = {"type": "integer"}
    for _ in range(50):
        schema = {"type": "array", "items": schema, "maxItems": 2}
    heavy = [{"guided_json": schema}, {"guided_regex": ".{0,5000}"},
             {"guided_regex": "((a{0,10}){0,10}){0,90}"},
             {"guided_regex": "((a{0,100}){0,100}){0,100}"},  # (past the bounds: a 400)
             {"guided_json": {"type": "object", "description": "x" * 20_000}}]
    served = Served(model, tmp_path)
    burner = "import time\nend = time.time() + 240\nwhile time.time() < end:\n    pass\n"
    with served.running():
        burners = [subprocess.Popen([sys.executable, "-c", burner]) for _ in range(10)]
        try:
            with ThreadPoolExecutor(8) as pool:
                loads = [pool.submit(httpx.post, served.api + "/v1/completions", timeout=600,
                                     json={"model": "tiny", "prompt": "Hi", "max_tokens": 24,
                                           "temperature": 0, **extra})
                         for extra in heavy * 3]
                bystanders = []
                for i in range(8):  # (bounded: one after another while the load runs)
                    bystanders.append(httpx.post(
                        served.api + "/v1/completions", timeout=600,
                        json={"model": "tiny", "prompt": f"Say {i}", "max_tokens": 1}))
                    ready = httpx.get(served.health + "/v2/health/ready", timeout=60)
                    assert ready.status_code == 200, ready.text
                answers = [f.result() for f in loads]
        finally:
            for p in burners:
                p.kill()
                p.wait(30)
        assert [r.status_code for r in bystanders] == [200] * 8
        assert {r.status_code for r in answers} <= {200, 400}, [r.text for r in answers]
        assert sum(r.status_code == 400 for r in answers) >= 3  # (the refused regex)
        assert served.process.poll() is None
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(120) == 0
    output = served.process.stdout.read().decode()
    assert "declared dead" not in output and "engine core died" not in output, output[-3000:]
