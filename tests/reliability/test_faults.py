"""Catalogue F1-F3 and F8-F10 on service apps over engine-core processes (fast), F5-F7 and
F11 on `tokenmill serve` process trees (crash, stall, drain, start-up failure), P2 along the
way (liveness and readiness through the lifecycle)."""

import contextlib
import json
import os
import pathlib
import signal
import socket
import struct
import threading
import time

import httpx
import pytest

from tests.reliability.checks import assert_openai_error, sse_events
from tests.serving import (
    DRAIN_TOKENS,
    HOLD_TOKENS,
    Served,
    alive,
    children,
    service_over_engine,
    wait_until,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FAULTS = str(pathlib.Path(__file__).parent / "faults")


def long_body(i: int, tokens: int = 400, **extra) -> dict:
    return {"model": "tiny", "prompt": f"story number {i}", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, **extra}


class Stream(threading.Thread):
    """One streaming completion in a thread; `leave_after` tokens, or `leave.set()`, then a
    graceful close (`rst=True`: an abortive close, TCP RST)."""

    def __init__(self, base: str, body: dict, leave_after: int | None = None,
                 rst: bool = False) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.leave_after, self.rst = base, body, leave_after, rst
        self.lines: list[str] = []
        self.started = threading.Event()
        self.leave = threading.Event()
        self.status, self.headers = None, None
        self.answered = threading.Event()  # the response's status line arrived
        self.wait_s: float | None = None  # from sending the request to its status line
        self.ended_at: float | None = None  # wall clock, when the stream closed

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.ended_at = time.time()

    def _run(self) -> None:
        if self.rst:
            return self._run_raw()
        sent = time.monotonic()
        with httpx.stream("POST", self.base + COMPLETIONS, json={**self.body, "stream": True},
                          timeout=120) as resp:
            self.status, self.wait_s = resp.status_code, time.monotonic() - sent
            self.headers = resp.headers
            self.answered.set()
            tokens = 0
            for line in resp.iter_lines():
                self.lines.append(line)
                if line.startswith("data: {"):
                    self.started.set()
                    tokens += 1
                if self.leave.is_set() or (self.leave_after is not None
                                           and tokens >= self.leave_after):
                    return
        self.started.set()

    def _run_raw(self) -> None:
        sock = open_raw_stream(self.base, self.body)
        received = b""
        while received.count(b"data: {") < (self.leave_after or 1):
            received += sock.recv(65536)
        self.started.set()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST

    def response(self) -> httpx.Response:
        """What came back, as one response (for a refusal's checks)."""
        return httpx.Response(self.status, headers=self.headers,
                              content="\n".join(self.lines).encode())

    def text(self) -> str:
        events, done = sse_events(self.lines)
        assert done == 1
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def leave_all(streams: list[Stream]) -> None:
    """The clients of accepted streams leave (waiting ones once they get their first
    token); every request ends and frees its slot."""
    for s in streams:
        s.leave.set()
    for s in streams:
        s.join(60)
        assert not s.is_alive() and s.status == 200


def open_raw_stream(base: str, body: dict) -> socket.socket:
    """A streaming request on a plain socket (so the test controls exactly when it closes)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


@contextlib.contextmanager
def engine_app(tiny_models, metrics=True, arch="llama", **engine):
    """A running service app over its own engine-core process (limits for one test)."""
    from tokenmill.config import EngineConfig
    from tokenmill.metrics import Metrics

    path = tiny_models(arch)[0]
    max_waiting = engine.pop("max_waiting", 64)
    max_num_seqs = engine.get("max_num_seqs", EngineConfig.max_num_seqs)  # the default
    registry = Metrics("tiny", max_num_seqs) if metrics else None
    with service_over_engine(path, registry, engine, max_dec_len=256,
                             max_waiting=max_waiting) as thread:
        yield thread


@pytest.fixture(scope="module")
def small(tiny_models):
    """Two running slots and eight waiting ones (F2, F8), on the long-context model: room
    for requests that are still running whenever the test looks (HOLD_TOKENS)."""
    with engine_app(tiny_models, arch="llama_long", max_num_seqs=2, max_waiting=8) as thread:
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
        streams = [Stream(served.api, long_body(i, HOLD_TOKENS)) for i in range(4)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(60)
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
        streams = [Stream(served.api, long_body(i, DRAIN_TOKENS)) for i in range(4)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(60)
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

        def probe() -> None:
            while not done.is_set() and len(probes) < 10_000:
                probes.append(httpx.get(served.health + "/v2/health/ready",
                                        timeout=30).status_code)
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
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60) == 0
    output = served.process.stdout.read().decode()
    assert "declared dead" not in output and "engine core died" not in output, output[-2000:]
